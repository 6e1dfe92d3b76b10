"""hvdp doctor: on this machine everything hvdp needs is there; each diagnosis from the facts it judges."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from hvdp import doctor as hvdp_doctor


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "hvdp.cli", "doctor", *args], capture_output=True,
                          text=True, check=False, timeout=300)


@pytest.mark.slow
def test_doctor_lists_both_frameworks_and_both_controllers():
    out = doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for needle in ("horovod     0.28.1", "torch       2.13.0", "tensorflow  2.21.0", "keras       3.",
                   "Open MPI", "Frameworks usable: torch, tensorflow", "Controllers usable: Gloo, MPI",
                   "No problems found.", "OK: Horovod can run a job."):
        assert needle in text, needle
    report = json.loads(doctor("--json").stdout)
    assert report["ok"] is True
    assert all(report["built"][name]["gloo"] and report["built"][name]["mpi"] for name in ("torch", "tensorflow"))


# Each diagnosis, from the facts diagnose() collects (assess() is where they are judged).

_OK = {"gloo": True, "mpi": True, "nccl": 0, "cuda": False}
_BOTH = {"torch": "2.13.0", "tensorflow": "2.21.0"}
_RECORD = {"inputs": {"frameworks": dict(_BOTH)}}


def _assess(frameworks=_BOTH, built=None, record=_RECORD, has_mpirun=True, horovod="0.28.1"):
    built = {name: dict(_OK) for name in frameworks} if built is None else built
    return hvdp_doctor.assess({"horovod": horovod}, dict(frameworks), built, record, has_mpirun)


def test_a_healthy_installation_has_no_problems():
    report = _assess()
    assert report.ok and report.problems == [] and report.usable == ["torch", "tensorflow"]
    assert report.controllers == ["gloo", "mpi"]


def test_no_framework_and_no_horovod_each_name_the_fix():
    report = _assess(frameworks={}, horovod=None)
    assert report.problems == ["Neither torch nor tensorflow is installed. Fix: pip install 'hvdp[torch]' or "
                               "pip install 'hvdp[tensorflow]'.", "Horovod is not installed. Fix: hvdp build"]
    assert not report.ok and report.built == {}


def test_a_framework_horovod_cannot_load_is_not_usable():
    report = _assess(built={"torch": dict(_OK), "tensorflow": {"error": "ImportError: undefined symbol"}})
    assert report.usable == ["torch"] and report.ok
    assert report.problems == ["Horovod cannot load its tensorflow support (ImportError: undefined symbol). "
                               "Fix: hvdp build (rebuilds for the frameworks installed now)"]


def test_mpi_without_mpirun_leaves_gloo():
    report = _assess(has_mpirun=False)
    assert report.controllers == ["gloo"] and report.ok
    assert report.problems == ["Horovod was built with MPI but mpirun is not on PATH. "
                               "Fix: apt-get install -y openmpi-bin (or use --gloo)."]


def test_no_controller_means_no_job():
    no_controller = {**_OK, "gloo": False, "mpi": False}
    report = _assess(built={"torch": no_controller, "tensorflow": no_controller})
    assert not report.ok
    assert report.problems == ["Horovod has no usable controller (neither Gloo nor MPI). Fix: hvdp build"]
    mpi_only = {**_OK, "gloo": False}
    report = _assess(built={"torch": mpi_only, "tensorflow": mpi_only}, has_mpirun=False)
    assert not report.ok and len(report.problems) == 2 and "no usable controller" in report.problems[1]


def test_a_horovod_not_built_by_hvdp_or_built_for_other_frameworks_is_named():
    assert _assess(record=None).problems == [
        "This Horovod was not built by hvdp build, so it may lack the fixes for current frameworks. Fix: hvdp build"]
    report = _assess(record={"inputs": {"frameworks": {"torch": "2.12.0"}}})
    assert report.problems == [
        "Horovod was built for torch 2.12.0 but 2.13.0 is installed now. Fix: hvdp build",
        "tensorflow 2.21.0 is installed but Horovod was built without it. Fix: hvdp build"]
    assert _assess(record={"inputs": "not a dict"}).problems[0].startswith("torch 2.13.0 is installed but")


def test_a_probe_that_fails_or_hangs_is_an_error_fact_not_a_traceback(monkeypatch):
    assert hvdp_doctor.probe(["torch"], timeout=0.01) == {
        "torch": {"error": "importing horovod.torch took over 0 s"}}
    monkeypatch.setattr(hvdp_doctor, "_PROBE", "import sys; sys.exit('no facts: boom')")
    assert hvdp_doctor.probe(["torch"]) == {"torch": {"error": "no facts: boom"}}
    monkeypatch.setattr(hvdp_doctor, "_PROBE", "import sys; sys.exit(3)")
    assert hvdp_doctor.probe(["torch"]) == {"torch": {"error": "exit code 3"}}


def test_render_and_json_say_not_ok_with_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(hvdp_doctor, "diagnose", lambda: _assess(frameworks={}, horovod=None))
    assert hvdp_doctor.main(argparse.Namespace(json=False)) == 1
    text = capsys.readouterr().out
    assert "Problems:\n  - Neither torch nor tensorflow" in text
    assert text.endswith("NOT OK: Horovod cannot run a job.\n")
    assert hvdp_doctor.main(argparse.Namespace(json=True)) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False

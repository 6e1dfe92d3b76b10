"""hvdp doctor on this machine: everything hvdp needs is there."""

from __future__ import annotations

import json
import subprocess
import sys


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "hvdp.cli", "doctor", *args], capture_output=True,
                          text=True, check=False, timeout=300)


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

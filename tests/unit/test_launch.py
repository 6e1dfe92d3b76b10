"""hvdp run: the command and environment it builds, checked without starting processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hvdp.errors import LaunchError
from hvdp.launch import build_command, horovodrun_arity, parse_run_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "train_digits.py")


@pytest.fixture(scope="module")
def arity():
    return horovodrun_arity()


def test_horovodrun_arity_comes_from_horovodrun_itself(arity):
    assert arity["--network-interface"] == 1 and arity["--verbose"] == 0 and arity["-p"] == 1


def test_defaults_gloo_framework_env_and_thread_split(arity):
    args = parse_run_args(["-np", "2", "--framework", "torch", SCRIPT, "--epochs", "3"], arity)
    argv, env = build_command(args, {}, cpu_count=8, horovodrun="horovodrun")
    assert argv == ["horovodrun", "-np", "2", "--gloo", sys.executable, SCRIPT, "--epochs", "3"]
    assert env == {"HVDP_FRAMEWORK": "torch", "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "4",
                   "TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "1"}


def test_user_settings_win_over_defaults(arity):
    args = parse_run_args(["-np", "4", "--mpi", "python", "train.py"], arity)
    _, env = build_command(args, {"OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}, cpu_count=2)
    assert "OMP_NUM_THREADS" not in env and env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert "HVDP_FRAMEWORK" not in env


def test_unknown_flags_pass_through_with_their_values(arity):
    args = parse_run_args(["-np", "2", "--network-interface", "lo", "--verbose", "-H", "a:1,b:1",
                           "--start-timeout=30", "python", "-u", "t.py", "--lr", "1"], arity)
    argv, env = build_command(args, {}, cpu_count=2)
    assert argv == ["horovodrun", "-np", "2", "--gloo", "-H", "a:1,b:1", "--network-interface", "lo",
                    "--verbose", "--start-timeout=30", "python", "-u", "t.py", "--lr", "1"]
    assert "OMP_NUM_THREADS" not in env  # hosts given: hvdp does not guess their cores


@pytest.mark.parametrize("argv, message", [
    (["--framework", "torch", "t.py"], "-np is required"),
    (["-np", "two", "t.py"], "'two' is not a number"),
    (["-np", "0", "t.py"], "must be at least 1"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--framework", "pytorch", "t.py"], "Unknown framework 'pytorch'"),
    (["-np", "2", "--gloo", "--mpi", "t.py"], "choose one controller"),
    (["-np", "2", "--bogus", "t.py"], "unknown option '--bogus'"),
    (["-np", "2", "-H", "a:1", "--hostfile", "h", "t.py"], "not both"),
])
def test_bad_arguments_name_the_value_and_the_fix(arity, argv, message):
    with pytest.raises(LaunchError, match=message):
        parse_run_args(argv, arity)


def test_launcher_and_environment_contradictions_are_refused(arity):
    args = parse_run_args(["-np", "2", "--framework", "tensorflow", "python", "t.py"], arity)
    with pytest.raises(LaunchError, match="contradicts HVDP_FRAMEWORK=torch"):
        build_command(args, {"HVDP_FRAMEWORK": "torch"}, cpu_count=2)
    with pytest.raises(LaunchError, match="contradicts KERAS_BACKEND=jax"):
        build_command(args, {"KERAS_BACKEND": "jax"}, cpu_count=2)


def test_missing_script_and_missing_mpirun(arity):
    with pytest.raises(LaunchError, match="script 'nope.py' not found"):
        build_command(parse_run_args(["-np", "2", "nope.py"], arity), {}, cpu_count=2)
    with pytest.raises(LaunchError, match="mpirun not found.*openmpi-bin"):
        build_command(parse_run_args(["-np", "2", "--mpi", "python", "t.py"], arity), {"PATH": "/nonexistent"}, 2)


def test_dry_run_prints_command_and_environment():
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "--framework", "tensorflow",
                          "--dry-run", SCRIPT], capture_output=True, text=True, cwd=REPO, check=False,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "HVDP_FRAMEWORK=tensorflow" in lines and "KERAS_BACKEND=tensorflow" in lines
    assert lines[-1].endswith(f"-np 2 --gloo {sys.executable} {SCRIPT}")


def test_cli_reports_errors_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "--framework", "mxnet", "t.py"],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("hvdp: error: Unknown framework 'mxnet'") and "Traceback" not in out.stderr

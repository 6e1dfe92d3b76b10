"""hvdp run --elastic: the horovodrun flags it builds, and every bad input refused with the value and the fix.

The discovery scripts here are real executables run in a subprocess, as horovodrun runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hvdp.errors import LaunchError
from hvdp.launch import build_command, check_discovery_script, horovodrun_arity, parse_run_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "train_digits.py")


@pytest.fixture(scope="module")
def arity():
    return horovodrun_arity()


def script(folder: Path, body: str, name: str = "discover.sh", executable: bool = True) -> str:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755 if executable else 0o644)
    return str(path)


def test_elastic_flags_become_horovodrun_flags(arity, tmp_path):
    discover = script(tmp_path, "echo localhost:2")
    args = parse_run_args(["--elastic", "--min-np", "1", "--max-np", "4", "--host-discovery-script", discover,
                           "--framework", "torch", "python", "t.py"], arity)
    assert (args.elastic, args.min_np, args.max_np, args.num_proc) == (True, 1, 4, None)
    argv, env = build_command(args, {}, cpu_count=8)
    assert argv == ["horovodrun", "-np", "1", "--gloo", "--host-discovery-script", discover, "--min-np", "1",
                    "--max-np", "4", "--slots-per-host", "1", "--elastic-timeout", "120", "python", "t.py"]
    assert env["OMP_NUM_THREADS"] == "2"  # the cores are split among up to --max-np processes


def test_elastic_np_defaults_min_np_and_user_slots_per_host_wins(arity, tmp_path):
    discover = script(tmp_path, "echo localhost")
    args = parse_run_args(["-np", "2", "--elastic", f"--host-discovery-script={discover}", "--slots-per-host", "2",
                           "--blacklist-cooldown-range", "1", "2", "python", "t.py"], arity)
    assert (args.min_np, args.max_np) == (2, None)
    argv, _ = build_command(args, {}, cpu_count=2)
    assert argv == ["horovodrun", "-np", "2", "--gloo", "--host-discovery-script", discover, "--min-np", "2",
                    "--elastic-timeout", "120", "--slots-per-host", "2", "--blacklist-cooldown-range", "1", "2",
                    "python", "t.py"]


def test_elastic_timeout_is_hvdps_own_flag_with_a_default_of_120_s(arity, tmp_path):
    discover = script(tmp_path, "echo localhost:2")
    args = parse_run_args(["--elastic", "-np", "1", "--elastic-timeout", "30", "--host-discovery-script", discover,
                           "python", "t.py"], arity)
    argv, _ = build_command(args, {}, cpu_count=2)
    assert args.elastic_timeout == 30 and argv.count("--elastic-timeout") == 1
    assert argv[argv.index("--elastic-timeout") + 1] == "30"
    args = parse_run_args(["--elastic", "-np", "1", "--elastic-timeout=7", "--host-discovery-script", discover,
                           "python", "t.py"], arity)
    assert args.elastic_timeout == 7
    assert parse_run_args(["-np", "1", "python", "t.py"], arity).elastic_timeout is None


def test_elastic_ignores_the_slurm_allocation_for_hosts(arity, tmp_path):
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    args = parse_run_args(["--elastic", "--min-np", "1", "--host-discovery-script", script(tmp_path, "echo n1:1"),
                           "python", "t.py"], arity)
    argv, _ = build_command(args, slurm, cpu_count=2)
    assert "-H" not in argv and argv[1:3] == ["-np", "1"]


def test_dry_run_prints_the_elastic_command_without_running_the_script(tmp_path):
    marker = tmp_path / "ran"
    discover = script(tmp_path, f"touch {marker}; echo localhost:2")
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "--elastic", "--min-np", "1", "--max-np", "2",
                          "--host-discovery-script", discover, "--dry-run", SCRIPT],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert f"--gloo --host-discovery-script {discover} --min-np 1 --max-np 2 --slots-per-host 1" in out.stdout
    assert not marker.exists()


@pytest.mark.parametrize("argv, message", [
    (["--elastic", "--min-np", "3", "--max-np", "2", "--host-discovery-script", "d.sh", "t.py"],
     r"--min-np 3 is greater than --max-np 2; the job could never run\. Give --min-np <= --max-np"),
    (["-np", "3", "--elastic", "--max-np", "2", "--host-discovery-script", "d.sh", "t.py"],
     r"-np 3 is greater than --max-np 2 \(-np is the --min-np when --min-np is not given\); the job could never"),
    (["-np", "5", "--elastic", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "d.sh", "t.py"],
     r"-np 5 is outside --min-np 1 and --max-np 4; .* give -np 1\.\.4"),
    (["-np", "1", "--elastic", "--min-np", "2", "--host-discovery-script", "d.sh", "t.py"],
     r"-np 1 is outside --min-np 2 and --max-np \(unbounded\); .* give -np at least 2"),
    (["--elastic", "--min-np", "0", "--host-discovery-script", "d.sh", "t.py"],
     r"--min-np '0' is not a process count; give a whole number of at least 1"),
    (["--elastic", "--max-np", "many", "--host-discovery-script", "d.sh", "t.py"],
     r"--max-np 'many' is not a process count"),
    (["--elastic", "--mpi", "--min-np", "1", "--host-discovery-script", "d.sh", "t.py"],
     r"--elastic needs the Gloo controller .* but --mpi was given\. Drop --mpi"),
    (["--elastic", "--min-np", "1", "t.py"], r"--elastic needs --host-discovery-script FILE"),
    (["--elastic", "--host-discovery-script", "d.sh", "t.py"], r"--elastic needs --min-np N \(or -np N\)"),
    (["--elastic", "-np", "2", "-H", "a:2", "--host-discovery-script", "d.sh", "t.py"],
     r"--elastic takes its hosts from --host-discovery-script, not -H or --hostfile"),
    (["-np", "2", "--min-np", "1", "t.py"], r"--min-np only applies to elastic jobs; add --elastic"),
    (["-np", "2", "--host-discovery-script", "d.sh", "t.py"],
     r"--host-discovery-script only applies to elastic jobs; add --elastic"),
    (["-np", "2", "--elastic-timeout", "60", "t.py"], r"--elastic-timeout only applies to elastic jobs; add --elastic"),
    (["--elastic", "-np", "1", "--elastic-timeout", "0", "--host-discovery-script", "d.sh", "t.py"],
     r"--elastic-timeout '0' is not a whole number of seconds \(at least 1\); e\.g\. --elastic-timeout 120"),
    (["--elastic", "-np", "1", "--elastic-timeout", "2m", "--host-discovery-script", "d.sh", "t.py"],
     r"--elastic-timeout '2m' is not a whole number of seconds"),
])
def test_bad_elastic_arguments_name_the_values_and_the_fix(arity, argv, message):
    with pytest.raises(LaunchError, match=message):
        parse_run_args(argv, arity)


def test_missing_or_non_executable_discovery_script_names_the_path_and_chmod(arity, tmp_path):
    missing = str(tmp_path / "nope.sh")
    args = parse_run_args(["--elastic", "-np", "1", "--host-discovery-script", missing, "python", "t.py"], arity)
    with pytest.raises(LaunchError, match=f"--host-discovery-script '{missing}' not found"):
        build_command(args, {}, cpu_count=2)
    with pytest.raises(LaunchError, match=f"--host-discovery-script '{missing}' not found"):
        check_discovery_script(missing)
    plain = script(tmp_path, "echo localhost:1", name="plain.sh", executable=False)
    args = parse_run_args(["--elastic", "-np", "1", "--host-discovery-script", plain, "python", "t.py"], arity)
    with pytest.raises(LaunchError, match=f"'{plain}' is not executable; Horovod runs it directly. "
                                          f"Fix: chmod \\+x {plain}"):
        build_command(args, {}, cpu_count=2)


def test_discovery_output_is_parsed_like_horovod_does(tmp_path):
    discover = script(tmp_path, "printf 'node1:2\\n\\n10.0.0.7\\nlocalhost:0\\n'")
    assert check_discovery_script(discover) == [("node1", 2), ("10.0.0.7", 1), ("localhost", 0)]


@pytest.mark.parametrize("body, message", [
    ("echo 'Available hosts:'; echo node1:2", r"printed 'Available hosts:' on line 1, which is not HOST or "
                                               r"HOST:SLOTS \(e\.g\. node1:2\)"),
    ("echo node1:2; echo node2 slots=2", r"printed 'node2 slots=2' on line 2"),
    ("echo node1:two", r"printed 'node1:two' on line 1"),
    ("echo 'cannot reach the scheduler' >&2; exit 3",
     r"exited with status 3 \(cannot reach the scheduler\); it must exit 0"),
])
def test_failing_or_garbage_discovery_script_names_the_script_and_the_line(tmp_path, body, message):
    discover = script(tmp_path, body)
    with pytest.raises(LaunchError, match=f"--host-discovery-script '{discover}' {message}"):
        check_discovery_script(discover)


def test_a_hung_discovery_script_is_ended_with_its_children(tmp_path):
    import time

    discover = script(tmp_path, "sleep 30; echo localhost:1")
    began = time.monotonic()
    with pytest.raises(LaunchError, match=f"'{discover}' did not finish in 1 s; Horovod runs it every second"):
        check_discovery_script(discover, timeout_s=1)
    assert time.monotonic() - began < 10  # the sleep (a child of the script) was killed too, closing its output


def test_discovery_script_is_run_through_the_shell_as_horovod_does(tmp_path):
    folder = tmp_path / "my hosts"
    folder.mkdir()
    plain = folder / "discover"
    plain.write_text("echo localhost:2\n")  # no #! line: the shell runs it
    plain.chmod(0o755)
    assert check_discovery_script(str(plain)) == [("localhost", 2)]
    binary = folder / "garbage"
    binary.write_bytes(b"\x7fELF\x02garbage")
    binary.chmod(0o755)
    with pytest.raises(LaunchError, match=r"garbage' exited with status 126 \(.*\); it must exit 0"):
        check_discovery_script(str(binary))


def test_a_path_with_spaces_reaches_horovod_quoted(arity, tmp_path):
    folder = tmp_path / "my hosts"
    folder.mkdir()
    discover = script(folder, "echo localhost:2")
    args = parse_run_args(["--elastic", "-np", "1", "--host-discovery-script", discover, "python", "t.py"], arity)
    argv, _ = build_command(args, {}, cpu_count=2)
    assert argv[argv.index("--host-discovery-script") + 1] == f"'{discover}'"


def test_cli_checks_the_discovery_script_before_starting_the_job(tmp_path):
    discover = script(tmp_path, "echo 'hosts: localhost'")
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "--elastic", "--min-np", "1",
                          "--host-discovery-script", discover, SCRIPT],
                         capture_output=True, text=True, cwd=REPO, check=False, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(f"hvdp: error: hvdp run: --host-discovery-script '{discover}' printed "
                                 f"'hosts: localhost' on line 1") and "Traceback" not in out.stderr

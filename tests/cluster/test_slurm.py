"""docker/slurm/hvdp.sbatch on a real two-node Slurm cluster (slurm.py): submitted with sbatch,
scheduled by slurmctld, run by slurmd on node n1, whose hvdp run starts one rank per node.

Each job is checked from Slurm's side (its final JobState and exit code), from its output file
(what hvdp run and rank 0 print) and from every rank (where it ran), and afterwards no process
of it is left on any node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from netns import SSH_PORT
from slurm import KILL_WAIT_S, SlurmCluster

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "docker" / "slurm" / "hvdp.sbatch"
DIGITS_RANK = Path(__file__).resolve().parent / "workers" / "digits_rank.py"
STEADY_RANK = Path(__file__).resolve().parent / "workers" / "steady_rank.py"
FAULTS = REPO / "tests" / "parallel" / "workers" / "faults.py"
#: A job that has not ended by then has hung: the test fails (and tear-down ends it).
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster in network namespaces needs root (CI runs as root)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as made:
        yield made
    assert made.leftovers() == [], "the Slurm cluster was not cleaned up"


def submit(slurm: SlurmCluster, out: Path, *script_args: str, framework: str = "torch") -> str:
    """sbatch hvdp.sbatch from the repository root, as a user would; returns the job id.

    The nodes have one CPU each (--cpus-per-task=1 instead of the script's 4), so each rank
    gets one thread from SLURM_CPUS_PER_TASK. The ssh options reach the nodes' test sshd.
    """
    env: Dict[str, Optional[str]] = {
        "HVDP_TEST_OUT": str(out), "HVDP_FRAMEWORK": framework, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": None, "SSH_CONNECTION": None,
        "OMP_NUM_THREADS": None, "TF_NUM_INTRAOP_THREADS": None, "TF_NUM_INTEROP_THREADS": None}
    job = slurm.run(["sbatch", "--parsable", "--cpus-per-task=1", "--time=10", f"--output={out}/job-%j.out",
                     str(SBATCH), "--ssh-port", str(SSH_PORT), "--ssh-identity-file", str(slurm.key),
                     "--network-interface", "eth0", "--disable-cache", "--start-timeout", "120", *script_args],
                    env=env, cwd=REPO)
    assert job.returncode == 0 and re.fullmatch(r"\d+\n", job.stdout), job.stdout
    return job.stdout.strip()


def finish(slurm: SlurmCluster, job_id: str, out: Path) -> Tuple[Dict[str, str], str, float]:
    """The job's final fields, its output file and its run time once it has ended."""
    start = time.monotonic()
    fields = slurm.wait(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), JOB_TIMEOUT_S)
    output = (out / f"job-{job_id}.out").read_text(errors="replace")
    assert fields["StdOut"] == str(out / f"job-{job_id}.out")
    return fields, output, time.monotonic() - start


def strays(slurm: SlurmCluster) -> Dict[str, List[str]]:
    """Processes on each node other than its sshd and slurmd: what a job left behind."""
    daemons = slurm.daemon_pids()
    return {name: [cmd for pid, cmd in slurm.processes(name).items() if pid not in daemons] for name in slurm.nodes}


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (an ended one may wait a while to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return re.search(r"^State:\s+Z", status, re.MULTILINE) is None


def wait_for_no_strays(slurm: SlurmCluster, timeout: float) -> Dict[str, List[str]]:
    deadline = time.monotonic() + timeout
    while True:
        left = strays(slurm)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def check_ranks(slurm: SlurmCluster, out: Path, output: str, framework: str, controller: str) -> None:
    """Rank r ran on node n<r+1>: rank 0 beside the batch script, rank 1 over ssh (or srun) from n1."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1], f"missing rank reports:\n{output[-6000:]}"
    n1, n2 = slurm.nodes["n1"], slurm.nodes["n2"]
    for rank, node in zip(ranks, (n1, n2)):
        assert rank["eth0"] == [node.address], rank
        assert (rank["size"], rank["local_size"], rank["local_rank"]) == (2, 1, 0), rank
        assert (rank["cross_size"], rank["cross_rank"]) == (2, rank["rank"]), rank
        assert rank["framework"] == framework, rank
        if controller == "mpi":
            assert rank["ompi_world_size"] == "2", rank
        else:
            assert rank["horovod_controller"] == "gloo" and rank["ompi_world_size"] is None, rank
    # Rank 0 is started by hvdp run's horovodrun (or mpirun) itself, in the batch step on n1.
    assert ranks[0]["ssh_connection"] is None, ranks[0]
    if controller == "mpi":
        # Open MPI's mpirun sees the allocation and starts its daemon on n2 with srun: job step 0.
        assert (ranks[1]["ssh_connection"], ranks[1]["slurm_step_id"]) == (None, "0"), ranks[1]
    else:
        # horovodrun starts rank 1 over ssh from n1, on the nodes' sshd port.
        assert ranks[0]["slurm_step_id"] is None and ranks[1]["slurm_step_id"] is None, ranks
        client, _, server, port = ranks[1]["ssh_connection"].split()
        assert (client, server, int(port)) == (n1.address, n2.address, SSH_PORT), ranks[1]
    assert len({r["netns"] for r in ranks}) == 2


def accuracy(output: str, framework: str) -> float:
    found = re.findall(rf"test accuracy: ([0-9.]+) \(\d+/360, {framework}, 2 processes", output)
    assert len(found) == 1, output[-4000:]  # printed once, by rank 0
    assert len(re.findall(r"epoch +\d+/20 +loss", output)) == 20
    return float(found[0])


def test_the_batch_script_trains_on_two_nodes_with_its_default_command(slurm, tmp_path):
    """Exactly what a user submits: no -H, no -np, no command; hosts and threads from Slurm."""
    job_id = submit(slurm, tmp_path)
    fields, output, took = finish(slurm, job_id, tmp_path)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-6000:]
    assert (fields["NodeList"], fields["BatchHost"], fields["NumNodes"]) == ("n[1-2]", "n1", "2")
    assert f"hvdp: Slurm job {job_id} on n[1-2], tasks per node 1(x2)" in output
    # The dry run the script prints first: hosts, slots, -np and threads from the allocation.
    assert f"-np 2 --gloo -H n1:1,n2:1 --ssh-port {SSH_PORT}" in output
    assert {"OMP_NUM_THREADS=1", "TF_NUM_INTRAOP_THREADS=1", "TF_NUM_INTEROP_THREADS=1"} <= set(output.splitlines())
    assert re.search(r"\S+/python\S* examples/train_digits\.py$", output, re.MULTILINE), output[:3000]
    assert accuracy(output, "torch") >= 0.95
    print(f"default command: COMPLETED in {took:.0f} s, accuracy {accuracy(output, 'torch')}")
    assert wait_for_no_strays(slurm, 30) == {"n1": [], "n2": []}


@pytest.mark.parametrize("framework, controller", [("torch", "mpi"), ("tensorflow", "gloo")])
def test_the_batch_script_runs_one_rank_per_node(slurm, framework, controller, tmp_path):
    """Each framework and each controller once: where the ranks run and how rank 1 is started (srun under
    mpirun, ssh under horovodrun) depend on the controller, not on the framework; torch under Gloo trains
    in the default command's job above."""
    job_id = submit(slurm, tmp_path, f"--{controller}", "--", str(DIGITS_RANK), framework=framework)
    fields, output, took = finish(slurm, job_id, tmp_path)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-6000:]
    check_ranks(slurm, tmp_path, output, framework, controller)
    reached = accuracy(output, framework)
    print(f"{framework}/{controller}: COMPLETED in {took:.0f} s, accuracy {reached}")
    assert reached >= 0.95, output[-3000:]
    assert wait_for_no_strays(slurm, 30) == {"n1": [], "n2": []}


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_raises_fails_the_job_with_the_cause_in_its_output(slurm, controller, tmp_path):
    job_id = submit(slurm, tmp_path, f"--{controller}", "--", str(FAULTS), "raise")
    fields, output, took = finish(slurm, job_id, tmp_path)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", output[-6000:]
    assert "rank 1 raised RuntimeError: injected failure at step 5" in output, output[-6000:]
    assert "rank 0 raised" not in output  # rank 0 only stopped because rank 1 failed
    cause = [line for line in output.splitlines() if "rank 1 raised" in line]
    print(f"raise/{controller}: {fields['JobState']} (exit {fields['ExitCode']}) in {took:.0f} s: {cause}")
    assert wait_for_no_strays(slurm, 30) == {"n1": [], "n2": []}


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_scancel_leaves_no_rank_on_any_node(slurm, controller, tmp_path):
    job_id = submit(slurm, tmp_path, f"--{controller}", "--", str(STEADY_RANK))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(list(tmp_path.glob("rank*.json"))) < 2:  # both ranks are up and reducing
        assert slurm.job(job_id)["JobState"] in ("PENDING", "RUNNING"), (tmp_path / f"job-{job_id}.out").read_text()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.5)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len({r["netns"] for r in ranks}) == 2  # one rank on each node
    assert all(running(r["pid"]) for r in ranks)
    cancelled = time.monotonic()
    slurm.slurm("scancel", job_id)
    fields, output, _ = finish(slurm, job_id, tmp_path)
    assert fields["JobState"] == "CANCELLED", output[-6000:]
    left = wait_for_no_strays(slurm, KILL_WAIT_S + 30)
    gone = time.monotonic() - cancelled
    assert left == {"n1": [], "n2": []}, f"after scancel, left on the nodes: {left}\n{output[-4000:]}"
    assert [r for r in ranks if running(r["pid"])] == []
    print(f"scancel/{controller}: CANCELLED, every rank gone {gone:.1f} s after scancel")


def test_the_batch_script_refuses_an_empty_command_after_the_separator(slurm, tmp_path):
    job_id = submit(slurm, tmp_path, "--mpi", "--")
    fields, output, _ = finish(slurm, job_id, tmp_path)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), output
    assert "hvdp.sbatch: nothing after --; give the command to run, e.g. -- train.py" in output


def test_the_slurm_cluster_is_removed_even_when_the_body_fails(tmp_path):
    """The clean-up path of the fixture: daemons, a running job, namespaces go, on error too."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster in network namespaces needs root (CI runs as root)")
    cluster = SlurmCluster(tmp_path, tag="t", subnet="10.77.3")  # beside the module's cluster
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            job_id = cluster.slurm("sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/sleep.out",
                                   "--wrap", "srun sleep 300").strip()
            cluster.wait(job_id, ("RUNNING",), 60)
            deadline = time.monotonic() + 30
            while not all(any("sleep 300" in cmd for cmd in cluster.processes(n).values()) for n in cluster.nodes):
                assert time.monotonic() < deadline, "the job's steps did not start on both nodes"
                time.sleep(0.5)
            pids = cluster.daemon_pids() | {pid for n in cluster.nodes for pid in cluster.processes(n)}
            assert len(pids) >= 3 + 2 * 2  # munged, slurmctld, slurmd and sshd per node, the job
            raise RuntimeError("boom")
    assert cluster.leftovers() == []
    assert [pid for pid in pids if running(pid)] == []


@pytest.mark.parametrize("args, expected", [
    ([], ["--framework", "torch", "examples/train_digits.py"]),
    (["--mpi", "-p", "2222"], ["--framework", "torch", "--mpi", "-p", "2222", "examples/train_digits.py"]),
    (["--mpi", "--", "train.py", "--lr", "1e-3", "--"], ["--framework", "torch", "--mpi", "train.py", "--lr", "1e-3",
                                                        "--"]),
    (["--", "train.py"], ["--framework", "torch", "train.py"]),
])
def test_the_batch_script_splits_hvdp_run_options_from_the_command(args, expected, tmp_path):
    """Without Slurm: hvdp run replaced by a recorder; the options go before the command, a
    command after -- replaces the default one, and the script checks and then runs it."""
    record = tmp_path / "hvdp"
    record.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$0.calls"\n')
    record.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HVDP": str(record), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_SUBMIT_DIR": str(tmp_path)}
    out = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hvdp: Slurm job 7 on n[1-2], tasks per node 1(x2)\n"
    assert (tmp_path / "hvdp.calls").read_text().splitlines() == [
        " ".join(["run", "--dry-run", *expected]), " ".join(["run", *expected])]


@pytest.mark.parametrize("env, message", [
    ({}, "SLURM_JOB_ID: not inside a Slurm allocation; submit with sbatch"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1"},
     "hvdp.sbatch: nothing after --; give the command to run, e.g. -- train.py"),
])
def test_the_batch_script_refuses_to_run_outside_slurm_or_without_a_command(env, message, tmp_path):
    out = subprocess.run(["bash", str(SBATCH), "--mpi", "--"], capture_output=True, text=True, timeout=30,
                         env={"PATH": os.environ["PATH"], "HVDP": "/bin/false", "SLURM_SUBMIT_DIR": str(tmp_path),
                              **env})
    assert out.returncode != 0 and message in out.stderr, out.stderr

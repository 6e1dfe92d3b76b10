"""A real multi-host job on this machine: hvdp run in a launcher namespace starts one rank on each
of two worker namespaces over ssh (their own address and sshd), and the digits example trains to
accuracy >= 0.95, with Gloo and with MPI. See netns.py for the hosts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from netns import SSH_PORT, Cluster, namespaces, remove_leftovers

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "digits_rank.py"
HVDP = [sys.executable, "-m", "hvdp.cli"]
#: A job that has not finished by then has hung: it is killed and the test fails.
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made
    assert made.leftovers() == [], "the cluster was not cleaned up"


def job_env(out: Path) -> dict:
    """The launcher's environment, which horovodrun passes on to the remote ranks.

    The two "hosts" share this machine's cores, so each rank gets one thread, as hvdp run
    would set for a local job (for remote hosts it sets none: it cannot know their cores).
    Unset, torch's threads and Gloo's oversubscribe 2 cores and a 2 s job takes over a minute.
    """
    return {"HVDP_TEST_OUT": str(out), "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "HVDP_FRAMEWORK": "", "KERAS_BACKEND": "", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1"}


def read_ranks(out: Path, output: str) -> list:
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1], f"missing rank reports:\n{output[-6000:]}"
    return ranks


def check_job(cluster: Cluster, output: str, ranks: list, framework: str, controller: str) -> float:
    """Every rank ran on its own worker host, reached over ssh, in one 2-process job; returns the accuracy."""
    for rank, worker in zip(ranks, cluster.workers):
        assert rank["eth0"] == [worker.address], rank  # rank r on the r-th host of -H
        assert (rank["size"], rank["local_size"], rank["local_rank"]) == (2, 1, 0), rank
        assert (rank["cross_size"], rank["cross_rank"]) == (2, rank["rank"]), rank  # two hosts
        assert rank["framework"] == framework, rank
        # Started by the worker's sshd on the test's port, from the launcher's address.
        assert rank["ssh_connection"] is not None, rank
        client, _, server, port = rank["ssh_connection"].split()
        assert (client, server, int(port)) == (cluster.launcher.address, worker.address, SSH_PORT), rank
        if controller == "mpi":
            assert rank["ompi_world_size"] == "2", rank
        else:
            assert rank["horovod_controller"] == "gloo" and rank["ompi_world_size"] is None, rank
    own_netns = os.stat("/proc/self/ns/net").st_ino
    assert len({r["netns"] for r in ranks} | {own_netns}) == 3, "the ranks did not run in two other namespaces"
    for worker in cluster.workers:
        assert f"Accepted publickey for root from {cluster.launcher.address}" in cluster.sshd_log(worker)
    found = re.findall(r"test accuracy: ([0-9.]+) \((\d+)/(\d+), (\w+), 2 processes", output)
    assert len(found) == 1, output[-4000:]  # printed once, by rank 0
    accuracy, _, total, reported = found[0]
    assert int(total) == 360 and reported == framework
    # Rank 0's lines as it wrote them, through hvdp run's relay from the remote host, not horovodrun's tags.
    assert len(re.findall(r"^epoch +\d+/20 +loss", output, re.M)) == 20, output[-4000:]
    assert "<stdout>:" not in output and "<stderr>:" not in output, output[-4000:]
    return float(accuracy)


@pytest.mark.parametrize("controller, framework", [("mpi", "torch"), ("gloo", "tensorflow")])
def test_example_trains_across_two_hosts_over_ssh(cluster, controller, framework, tmp_path):
    """Each framework and each controller once: how rank 1 is started on its host (horovodrun's ssh, mpirun's)
    depends on the controller, not on the framework; torch under Gloo crosses the hosts in the test below."""
    hosts = ",".join(f"{w.address}:1" for w in cluster.workers)
    job = cluster.run(cluster.launcher, [
        *HVDP, "run", "-np", "2", "-H", hosts, "--ssh-port", str(SSH_PORT), "--ssh-identity-file", str(cluster.key),
        "--network-interface", "eth0", f"--{controller}", "--framework", framework,
        "--disable-cache", "--start-timeout", "120", str(WORKER),
    ], timeout=JOB_TIMEOUT_S, env=job_env(tmp_path), cwd=REPO)
    assert job.returncode == 0, f"hvdp run exited {job.returncode}:\n{job.stdout[-8000:]}"
    ranks = read_ranks(tmp_path, job.stdout)
    accuracy = check_job(cluster, job.stdout, ranks, framework, controller)
    assert accuracy >= 0.95, job.stdout[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_remote_ranks_exception_is_named_from_its_record(cluster, controller, tmp_path):
    hosts = ",".join(f"{w.address}:1" for w in cluster.workers)
    job = cluster.run(cluster.launcher, [
        *HVDP, "run", "-np", "2", "-H", hosts, "--ssh-port", str(SSH_PORT), "--ssh-identity-file", str(cluster.key),
        "--network-interface", "eth0", f"--{controller}", "--framework", "torch", "--disable-cache",
        "--start-timeout", "120", str(REPO / "tests" / "parallel" / "workers" / "faults.py"), "raise",
    ], timeout=JOB_TIMEOUT_S, env=job_env(tmp_path), cwd=REPO)
    assert job.returncode != 0
    lines = job.stdout.splitlines()
    assert any(re.fullmatch(r"hvdp: rank 1 on \S+:", line) for line in lines), job.stdout[-4000:]
    assert lines.count("[1] Traceback (most recent call last):") == 1, job.stdout[-4000:]
    assert "hvdp: the job failed: rank 1 raised RuntimeError: injected failure at step 5" in job.stdout
    assert "rank 0 raised" not in job.stdout and "<stderr>:" not in job.stdout, job.stdout[-4000:]


def test_cluster_is_removed_even_when_the_body_fails(tmp_path):
    """The clean-up path of every test above: processes, namespaces and links go, on error too."""
    cluster = Cluster(tmp_path, tag="c", subnet="10.77.1")  # beside the module's cluster
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            assert cluster.workers[0].netns in namespaces()
            sshd_pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", cluster.workers[0].netns],
                                                        capture_output=True, text=True).stdout.split()]
            assert sshd_pids, "sshd is not running in the worker namespace"
            raise RuntimeError("boom")
    assert cluster.leftovers() == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in sshd_pids)
    assert remove_leftovers() == []  # nothing of a finished cluster is left for the next run to clean

"""SIGTERM to `hvdp run` ends the ranks it started on other hosts over ssh, for real.

hvdp run runs in the launcher namespace and starts one rank on each of two worker
namespaces over ssh (see netns.py). horovodrun's ssh sessions have no terminal, so ending
the local ssh clients would leave the remote ranks training; hvdp run ends them by their
job id on each host. The ranks are in this machine's PID space, so the test sees them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import SSH_PORT, Cluster

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "parallel" / "workers" / "signal_loop.py"
HVDP = [sys.executable, "-m", "hvdp.cli"]


def ancestors(pid: int) -> list:
    """(pid, command name) of ``pid``'s parent, its parent's, ... up to init, from /proc."""
    chain = []
    while pid > 1:
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if pid <= 0:
            break
        chain.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
    return chain


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), tag="s", subnet="10.77.3") as made:
        yield made
    assert made.leftovers() == [], "the cluster was not cleaned up"


def job_processes(out: Path) -> list:
    marker = f"HVDP_TEST_OUT={out}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_sigterm_ends_the_ranks_on_remote_hosts(cluster, controller, tmp_path):
    hosts = ",".join(f"{w.address}:1" for w in cluster.workers)
    env = cluster.env({"HVDP_TEST_OUT": str(tmp_path), "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                       "HVDP_FRAMEWORK": None, "KERAS_BACKEND": None, "OMP_NUM_THREADS": "1"})
    log = (tmp_path / "output.txt").open("w")
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.launcher.netns, *HVDP, "run", "-np", "2", "-H", hosts,
                             "--ssh-port", str(SSH_PORT), "--ssh-identity-file", str(cluster.key),
                             "--network-interface", "eth0", f"--{controller}", "--framework", "torch",
                             "--start-timeout", "120", str(WORKER), "plain"],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("rank*.json"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "output.txt").read_text()[-4000:]
            time.sleep(0.2)
        time.sleep(1)
        ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
        # Each rank runs under its host's sshd, not under hvdp run.
        for rank in ranks:
            chain = ancestors(rank["pid"])
            names = [name for _, name in chain]
            assert "sshd" in names, chain
            assert proc.pid not in [pid for pid, _ in chain[:names.index("sshd")]], chain
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
        time.sleep(0.5)
        output = (tmp_path / "output.txt").read_text()
        left = job_processes(tmp_path)
        assert not left, f"left running: {left}\n{output[-3000:]}"
        assert code == 128 + signal.SIGTERM, output[-3000:]
        last = output.strip().splitlines()[-1]
        addresses = " and ".join(f"the ranks on {w.address}" for w in cluster.workers)
        assert last.startswith("hvdp run: stopped by SIGTERM: ended ") and addresses in last, last
        assert took < 10, took
        print(f"\n{controller} over ssh: ended in {took:.2f} s: {last}")
    finally:
        for pid in job_processes(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()

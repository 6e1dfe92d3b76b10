"""hvdp on a two-node Ray cluster: a head node and a worker node, each in its own network namespace (its own
address, netns.py), started with ``ray start``; examples/ray_digits.py's driver joins from the head's namespace.

With ``placement_strategy=STRICT_SPREAD`` each run puts one worker on each node, so hvdp's Gloo job spans the
two namespaces: every worker reports its node's address, local size 1 and cross size 2. The torch and the
Keras-on-TensorFlow runs go side by side (each node has 2 CPUs: one worker of each run) and each trains the
digits to an accuracy of 0.9 or more.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import Cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ray_digits.py"
RAY = str(Path(sys.executable).parent / "ray")
SUBNET = "10.77.31"
PORT = 6379
#: A run that has not ended by then has hung: it is killed and the test fails.
TIMEOUT_S = 300


#: The cluster's token: Ray 2.60 authenticates every connection to a cluster (nodes, drivers) with one.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}


def ray_start(cluster: Cluster, host, temp: Path, *args: str) -> None:
    """``ray start`` of one node inside ``host``'s namespace (it returns once the node's processes run)."""
    started = time.perf_counter()
    out = cluster.run(host, [RAY, "start", f"--node-ip-address={host.address}", "--num-cpus=2",
                             "--disable-usage-stats", f"--temp-dir={temp}", *args], timeout=180,
                      env=AUTH)
    assert out.returncode == 0, f"ray start on {host.name}: {out.stdout[-4000:]}"
    print(f"\nray start on {host.name} ({host.address}): {time.perf_counter() - started:.1f} s")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Head on the namespace 'launcher', one worker node on 'worker1'; every process of both ends with them."""
    work = tmp_path_factory.mktemp("raync")
    temps = [Path(f"/tmp/hr{os.getpid()}{kind}") for kind in "hw"]  # short: Ray's socket paths live there
    try:
        with Cluster(work, workers=1, tag="r", subnet=SUBNET) as made:
            head, worker = made.launcher, made.workers[0]
            ray_start(made, head, temps[0], "--head", f"--port={PORT}", "--include-dashboard=false")
            ray_start(made, worker, temps[1], f"--address={head.address}:{PORT}")
            yield made
            for host in made.hosts:  # Ray's daemons take seconds to heed SIGTERM; the cluster goes anyway
                for pid in subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                                          timeout=30).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    assert made.leftovers() == [], "the cluster was not cleaned up"


def start_run(cluster: Cluster, tmp_path: Path, framework: str) -> subprocess.Popen:
    env = cluster.env({**AUTH, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "HVDP_FRAMEWORK": None,
                       "KERAS_BACKEND": None})
    return subprocess.Popen(["ip", "netns", "exec", cluster.launcher.netns, sys.executable, str(EXAMPLE),
                             "--address", f"{cluster.launcher.address}:{PORT}", "--framework", framework,
                             "--epochs", "5", "--placement-strategy", "STRICT_SPREAD",
                             "--storage", str(tmp_path / f"results-{framework}"),
                             "--json", str(tmp_path / f"{framework}.json")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_torch_and_keras_train_across_two_nodes(ray_cluster, tmp_path):
    """Two Ray runs side by side, each starting its workers on both nodes and importing its framework there:
    about 60 s on 2 cores, most of it Ray's start and the imports (5 epochs of training take seconds)."""
    runs = {framework: start_run(ray_cluster, tmp_path, framework) for framework in ("torch", "tensorflow")}
    addresses = {host.address for host in ray_cluster.hosts}
    for framework, proc in runs.items():
        try:
            printed, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            printed, _ = proc.communicate()
        assert proc.returncode == 0, f"{framework} (exit code {proc.returncode}): {printed[-6000:]}"
        result = json.loads((tmp_path / f"{framework}.json").read_text())
        print(f"\n{framework}: {printed.strip().splitlines()[-1]}")
        assert result["accuracy"] >= 0.9, printed[-3000:]
        workers = result["workers"]
        assert [w["rank"] for w in workers] == [0, 1]
        assert {w["node_ip"] for w in workers} == addresses, workers  # one worker in each namespace
        for worker in workers:
            assert worker["framework"] == worker["keras_backend"] == framework, worker
            assert (worker["local_rank"], worker["local_size"]) == (0, 1), worker
            assert (worker["cross_rank"], worker["cross_size"]) == (worker["rank"], 2), worker

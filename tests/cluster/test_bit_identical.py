"""Replicas on two hosts hold bit-identical gradients, parameters and optimizer state after every step.

hvdp run in a launcher namespace starts one rank on each of two worker namespaces over ssh (netns.py),
so the ranks share no memory and reduce over Gloo's ring between two addresses, as two containers or two
machines do; each rank runs its own number of torch threads (1 and 2). The worker
(workers/bit_identical_rank.py) compares every rank's sha256 digests after each backward pass (the
averaged gradients) and after each update (parameters, Adam's moments): the learning step on Horovod's
path, then the direct path's steps with an in-place bucket, two gathered ones on two lanes, the sender's
scale and the last bucket's. The drift guard checks after every step too (HVDP_CHECK_EVERY=1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from netns import SSH_PORT, Cluster

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "bit_identical_rank.py"
STEPS = 12
#: A job that has not finished by then has hung: it is killed and the test fails.
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), tag="b", subnet="10.77.9") as made:
        yield made
    assert made.leftovers() == [], "the cluster was not cleaned up"


def test_replicas_stay_bit_identical_after_every_step_across_two_hosts(cluster, tmp_path):
    hosts = ",".join(f"{w.address}:1" for w in cluster.workers)
    env = {"HVDP_TEST_OUT": str(tmp_path), "PYTHONUNBUFFERED": "1", "HVDP_FRAMEWORK": "", "KERAS_BACKEND": "",
           "OMP_NUM_THREADS": None, "HVDP_TEST_THREADS": "1,2", "HVDP_CHECK_EVERY": "1",
           "HVDP_GRADIENT_PATH": None}
    job = cluster.run(cluster.launcher, [
        sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "-H", hosts, "--ssh-port", str(SSH_PORT),
        "--ssh-identity-file", str(cluster.key), "--network-interface", "eth0", "--gloo", "--framework", "torch",
        "--disable-cache", "--start-timeout", "120", str(WORKER), "--steps", str(STEPS),
    ], timeout=JOB_TIMEOUT_S, env=env, cwd=REPO)
    assert job.returncode == 0, f"hvdp run exited {job.returncode}:\n{job.stdout[-8000:]}"
    assert "drifted apart" not in job.stdout, job.stdout[-4000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1], f"missing rank reports:\n{job.stdout[-6000:]}"
    for report in ranks:
        assert (report["size"], report["local_size"]) == (2, 1), report  # one rank per host: no shared memory
        assert report["mismatches"] == [], report["mismatches"]  # gradients, parameters, moments, every step
    assert [r["threads"] for r in ranks] == [1, 2]
    # The steps covered both paths and every kind of bucket: the learning step on Horovod's path, then direct.
    for report in ranks:
        assert report["paths"] == ["horovod"] + ["direct"] * (STEPS - 1), report["paths"]
        assert report["counts"] == {"direct": STEPS - 1, "horovod": 1, "changes": 0}, report["counts"]
        kinds = {(bucket["in_place"], bucket["lane"]) for bucket in report["plan"]}
        assert {(True, 0), (False, 0), (False, 1)} <= kinds, report["plan"]
    assert ranks[0]["plan"] == ranks[1]["plan"]

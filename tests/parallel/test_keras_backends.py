"""One Keras 3 model on both Keras backends: hvdp averages its gradients through the collectives of
the framework chosen by hvdp run --framework (np=2, Gloo and MPI)."""

from __future__ import annotations

import pytest
from harness import max_abs_diff, run_worker


@pytest.fixture(scope="module", params=[(f, c) for f in ("torch", "tensorflow") for c in ("gloo", "mpi")],
                ids=lambda p: "-".join(p))
def job(request, tmp_path_factory):
    framework, controller = request.param
    ran = run_worker("keras_fit.py", controller, framework, tmp_path_factory.mktemp(framework))
    ran.framework = framework
    return ran


def test_keras_runs_on_the_launcher_framework(job):
    assert {(r["framework"], r["keras_backend"]) for r in job.ranks} == {(job.framework, job.framework)}


def test_fit_on_different_data_keeps_replicas_identical_and_equals_one_process_on_the_union(job):
    r0, r1 = (r["fit"] for r in job.ranks)
    assert r0["before"] != r1["before"] and r0["start"] == r1["start"]  # broadcast_state
    assert r0["moved"] > 1e-2
    assert max_abs_diff(r0["after"], r1["after"]) <= 1e-6
    for rank in (r0, r1):
        assert rank["vs_union"]["close"], rank["vs_union"]  # rtol 1e-5, atol 1e-6


def test_callbacks_broadcast_average_metrics_and_warm_up(job):
    r0, r1 = (rank["callbacks"] for rank in job.ranks)
    assert r0["before"] != r1["before"] and r0["after"] == r1["after"]  # BroadcastInitialState
    assert r0["history"] == r1["history"] and r0["local_losses"] != r1["local_losses"]  # MetricAverage
    for local0, local1, averaged in zip(r0["local_losses"], r1["local_losses"], r0["history"]):
        assert averaged == pytest.approx((local0 + local1) / 2, rel=1e-6)
    lr = r0["lr"]  # LearningRateWarmup over 2 epochs of 4 batches, from 0.2 / 2 to 0.2
    assert lr[0] == pytest.approx(0.1) and lr[4] == pytest.approx(0.15) and lr[-1] == pytest.approx(0.2)
    assert all(b >= a for a, b in zip(lr, lr[1:])) and r0["final_lr"] == pytest.approx(0.2)

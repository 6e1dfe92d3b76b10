"""A Keras script written for one process keeps its meaning on every rank, as under
MultiWorkerMirroredStrategy (np=2, Gloo, both Keras backends): each rank validating on its own slice,
``EarlyStopping``, ``ReduceLROnPlateau`` and ``ModelCheckpoint(save_best_only=True)`` decide on the
union's metrics, and the run equals one process on the union of the batches and of the validation
slices; a rank-local ``model.stop_training`` stops every rank; fits that differ, and replicas that
part, are refused on every rank within seconds (tests/parallel/workers/keras_peers.py)."""

from __future__ import annotations

import pytest
from harness import run_worker, side_by_side

BACKENDS = ("torch", "tensorflow")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One keras_peers.py job per Keras backend, side by side."""
    futures = side_by_side({framework: (lambda f=framework: run_worker(
        "keras_peers.py", "gloo", f, tmp_path_factory.mktemp(f"peers-{f}"))) for framework in BACKENDS})
    return {framework: future.result() for framework, future in futures.items()}


@pytest.fixture(params=BACKENDS)
def job(request, jobs):
    return jobs[request.param]


def test_callbacks_read_the_unions_metrics_and_every_rank_stops_with_one_process(job):
    peers = [r["peers"] for r in job.ranks]
    reference = peers[0]["reference_history"]
    # EarlyStopping stopped the job where it stops one process on the union, before the 40 epochs
    assert {p["epochs"] for p in peers} == {peers[0]["reference_epochs"]}, [p["epochs"] for p in peers]
    assert 2 < peers[0]["epochs"] < 40
    for p in peers:
        assert p["history"] == peers[0]["history"]  # the same logs on every rank, bit for bit
        for key in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"):
            assert p["history"][key] == pytest.approx(reference[key], rel=2e-5, abs=1e-6), key
        assert p["saved"] == p["reference_saved"] and len(p["saved"]) >= 2  # save_best_only: the same epochs
        assert p["vs_reference"] <= 1e-5
        assert p["evaluate"] == peers[0]["evaluate"]
        assert p["evaluate"]["loss"] == pytest.approx(p["reference_evaluate"]["loss"], rel=1e-5)
        assert p["evaluate"]["accuracy"] == pytest.approx(p["reference_evaluate"]["accuracy"], abs=1e-6)
    assert len({p["digest"] for p in peers}) == 1
    # ReduceLROnPlateau lowered the rate on every rank at once (it acted on the union's val_loss)
    assert min(reference["learning_rate"]) < reference["learning_rate"][0]


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_place(job):
    local = [r["rank_local"] for r in job.ranks]
    for case, epochs, iterations in (("epoch", 2, 40), ("batch", 2, 23)):
        assert [r[case]["epochs"] for r in local] == [epochs, epochs], case
        assert [r[case]["iterations"] for r in local] == [iterations, iterations], case
        assert local[0][case]["digest"] == local[1][case]["digest"], case
    assert "hvdp: rank 1 (StopOnRank) set model.stop_training, so every rank stops training after epoch 2." \
        in job.output, job.output[-3000:]
    assert "after batch 3 of epoch 2." in job.output


def test_fits_that_differ_and_replicas_that_part_are_refused_on_every_rank_at_once(job):
    refusals = [r["refusals"] for r in job.ranks]
    for r in refusals:
        assert r["epochs"].startswith("TrainingMismatchError: model.fit differs between the ranks (rank 0: "
                                      "epochs 1-5 of 20 batches; rank 1: epochs 1-3 of 20 batches)"), r["epochs"]
        assert "rank 1: epochs 1-1 of 18 batches" in r["batches"], r["batches"]
        assert r["refused_in"] < 10
        assert r["nudged"].startswith("ReplicaMismatchError: Replicas drifted apart by step 20 (at the end of "
                                      "epoch 1)"), r["nudged"]
        assert r["nudge_found_in"] < 30
    assert refusals[0]["digest"] == refusals[1]["digest"]

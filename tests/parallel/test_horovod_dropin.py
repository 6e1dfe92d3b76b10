"""Existing Horovod scripts run unchanged on hvdp's Horovod build, Keras 3 included (np=2, Gloo and MPI).

The workers use only Horovod's own API (import horovod.tensorflow.keras as hvd, ...), as a
Horovod user's script does. Every rank starts from different weights and trains on different
data; every rank must end identical to the others and equal, within rtol 1e-5, to one process
(no Horovod) trained on the union of the ranks' batches.
"""

from __future__ import annotations

import pytest
from harness import WORKERS, max_abs_diff, run_job, run_worker


#: The Keras and the TensorFlow scripts call the same ops of hvdp's Horovod build (horovod.tensorflow's), which
#: take the controller from the job: one script under each controller runs TensorFlow's ops under both.
@pytest.fixture(scope="module", params=["gloo"])
def keras_job(request, tmp_path_factory):
    return run_worker("dropin_keras.py", request.param, "tensorflow", tmp_path_factory.mktemp("keras"))


@pytest.fixture(scope="module", params=["mpi"])
def tf_job(request, tmp_path_factory):
    return run_worker("dropin_tf.py", request.param, "tensorflow", tmp_path_factory.mktemp("tf"))


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def torch_job(request, tmp_path_factory):
    return run_worker("dropin_torch.py", request.param, "torch", tmp_path_factory.mktemp("torch"))


def _same_and_equal_to_one_process(ranks: list, key: str) -> None:
    r0, r1 = (r[key] for r in ranks)
    assert max_abs_diff(r0["after"], r1["after"]) <= 1e-6, key
    for rank in (r0, r1):
        assert rank["vs_union"]["close"], (key, rank["vs_union"])  # rtol 1e-5, atol 1e-6


def test_keras_fit_with_distributed_optimizer_averages_from_different_initial_weights(keras_job):
    r0, r1 = (r["fit"] for r in keras_job.ranks)
    assert r0["before"] != r1["before"]  # different initial weights until BroadcastGlobalVariablesCallback
    assert r0["moved"] > 1e-2
    _same_and_equal_to_one_process(keras_job.ranks, "fit")
    # The wrapped optimizer keeps its class (name and isinstance) and made one update per batch.
    assert (r0["class"], r0["is_adam"], r0["iterations"]) == ("Adam", True, 6)
    # MetricAverageCallback: the logged loss is the mean of the ranks' own losses.
    assert r0["history"] == r1["history"] and r0["local_losses"] != r1["local_losses"]
    for local0, local1, averaged in zip(r0["local_losses"], r1["local_losses"], r0["history"]):
        assert averaged == pytest.approx((local0 + local1) / 2, rel=1e-6)


def test_keras_custom_loop_apply_gradients_averages_eager_and_in_tf_function(keras_job):
    r0, r1 = (r["custom_loop"] for r in keras_job.ranks)
    assert r0["start"] == r1["start"]  # hvd.broadcast_variables on Keras 3 variables, opt.variables() too
    _same_and_equal_to_one_process(keras_job.ranks, "custom_loop")
    for rank in (r0, r1):  # a Keras 2 call Keras 3 cannot serve names its replacement
        assert rank["get_gradients"].startswith("AttributeError: Keras 3 optimizers do not compute gradients")
        assert "tf.GradientTape" in rank["get_gradients"] and "apply_gradients" in rank["get_gradients"]


def test_keras_backward_passes_per_step_sums_passes_and_averages_ranks(keras_job):
    _same_and_equal_to_one_process(keras_job.ranks, "accumulate")
    assert {r["accumulate"]["iterations"] for r in keras_job.ranks} == {2}


def test_keras_learning_rate_warmup_callback(keras_job):
    lr0, lr1 = (r["warmup"]["lr"] for r in keras_job.ranks)
    assert lr0 == lr1
    # initial_lr 0.4 on 2 ranks, warmup over 2 epochs of 2 batches: from 0.4/2 up to 0.4, then kept.
    assert lr0 == pytest.approx([0.25, 0.3, 0.35, 0.4, 0.4, 0.4], rel=1e-6)
    assert keras_job.ranks[0]["warmup"]["after"] == keras_job.ranks[1]["warmup"]["after"]


def test_keras_load_model_restores_a_distributed_optimizer_with_its_state(keras_job):
    r0 = keras_job.ranks[0]["load_model"]
    assert (r0["iterations_loaded"], r0["class"]) == (6, "Adam")
    _same_and_equal_to_one_process(keras_job.ranks, "load_model")
    for rank in keras_job.ranks:
        assert rank["load_model"]["legacy"].startswith("ValueError: legacy_opts=True loads keras.optimizers.legacy")
        assert "legacy_opts=False" in rank["load_model"]["legacy"]


def test_horovod_keras_callbacks_and_learning_rate_schedule_on_keras3(keras_job):
    r0, r1 = (r["standalone_keras"] for r in keras_job.ranks)
    assert r0["before"] != r1["before"] and r0["class"] == "SGD"
    _same_and_equal_to_one_process(keras_job.ranks, "standalone_keras")
    # LearningRateScheduleCallback: 0.1 halved each epoch, 3 batches an epoch, the same on every rank.
    expected = [0.1] * 3 + [0.05] * 3 + [0.025] * 3
    for rank in (r0, r1):
        assert rank["lr"] == pytest.approx(expected, rel=1e-6)
        assert rank["logged_lr"] == pytest.approx([0.1, 0.05, 0.025], rel=1e-6)
        assert len(rank["warnings"]) == 1 and "momentum_correction=False" in rank["warnings"][0], rank["warnings"]
    assert r0["history"] == r1["history"]  # MetricAverageCallback


def test_tf_distributed_gradient_tape_on_keras3_variables(tf_job):
    r0, r1 = (r["tape"] for r in tf_job.ranks)
    assert r0["before"] != r1["before"] and r0["start"] == r1["start"]  # hvd.broadcast_variables
    _same_and_equal_to_one_process(tf_job.ranks, "tape")
    _same_and_equal_to_one_process(tf_job.ranks, "tape_in_function")


def test_tf_broadcast_variables_inplace_on_keras3_variables(tf_job):
    digests = {r["inplace"]["after"] for r in tf_job.ranks}
    assert len(digests) == 1 and tf_job.ranks[0]["inplace"]["changed_on_rank1"]


def test_tf_partial_tape_keeps_local_layer_gradients_local(tf_job):
    for rank in tf_job.ranks:
        assert rank["partial"]["local_is_own_over_size"]["close"], rank["partial"]
        assert rank["partial"]["shared_is_average"]["close"], rank["partial"]


def test_tf_sync_batch_normalization_equals_batch_norm_on_the_union(tf_job):
    _same_and_equal_to_one_process(tf_job.ranks, "sync_bn")
    for rank in tf_job.ranks:
        assert rank["sync_bn"]["outputs_vs_union"]["close"], rank["sync_bn"]
        assert rank["sync_bn"]["moving_vs_union"]["close"], rank["sync_bn"]


def test_torch_sync_batch_norm_on_cpu_equals_batch_norm_on_the_union(torch_job):
    r0, r1 = torch_job.ranks
    assert r0["before"] != r1["before"]  # different initial weights until hvd.broadcast_parameters
    assert max_abs_diff(r0["after"], r1["after"]) <= 1e-6
    for rank in torch_job.ranks:  # weights and running statistics, then the outputs in eval mode
        assert rank["vs_union"]["close"], rank["vs_union"]
        assert rank["eval_outputs_vs_union"]["close"], rank["eval_outputs_vs_union"]


def test_elastic_keras_state_two_workers_to_one_and_back_with_a_new_unbuilt_optimizer(tmp_path):
    """horovod.tensorflow.keras's elastic API under `hvdp run --elastic` (Gloo): a worker is killed, rank 0
    trains on alone from its last commit, then a new worker joins whose Keras 3 optimizer was never built."""
    (tmp_path / "hosts").write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text('#!/bin/sh\ncat "$(dirname "$0")/hosts"\n')
    discover.chmod(0o755)
    job = run_job(["--elastic", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
                   "--blacklist-cooldown-range", "1", "2", "--framework", "tensorflow",
                   str(WORKERS / "dropin_elastic_keras.py")], tmp_path, np_=2, timeout=300)
    assert job.returncode == 0, job.output[-6000:]
    assert [r["rank"] for r in job.ranks] == [0, 1], job.output[-4000:]
    first, joined = sorted(job.ranks, key=lambda r: not r["first_incarnation"])  # Horovod may renumber them
    assert first["first_incarnation"] and not joined["first_incarnation"]
    assert first["sizes"] == [2, 1, 2] and joined["sizes"] == [2]
    assert first["resets"] == [1, 2] and joined["resets"] == []
    # The joined worker received rank 0's whole optimizer state: Adam's moments and its step counter.
    assert joined["optimizer_variables"] == first["optimizer_variables"] > 2
    assert joined["iterations"] == first["iterations"]
    for rank in job.ranks:
        assert rank["epoch"] == 4 and rank["max_abs_diff"] == 0.0 and rank["max_abs_diff_slots"] == 0.0, rank
    assert first["weights"] == joined["weights"] and first["slots"] == joined["slots"]

"""One Keras 3 model on both Keras backends: hvdp averages its gradients through the collectives of
the framework chosen by hvdp run --framework (np=2, Gloo and MPI)."""

from __future__ import annotations

import pytest
from harness import max_abs_diff, run_worker

_JOBS: dict = {}


def keras_job(framework, controller, tmp_path_factory):
    """One keras_fit.py job per (framework, controller), shared by every test of this module."""
    if (framework, controller) not in _JOBS:
        out_dir = tmp_path_factory.mktemp(framework)
        ran = run_worker("keras_fit.py", controller, framework, out_dir)
        ran.framework, ran.controller, ran.out_dir = framework, controller, out_dir
        _JOBS[framework, controller] = ran
    return _JOBS[framework, controller]


@pytest.fixture(scope="module", params=[(f, c) for f in ("torch", "tensorflow") for c in ("gloo", "mpi")],
                ids=lambda p: "-".join(p))
def job(request, tmp_path_factory):
    return keras_job(*request.param, tmp_path_factory)


def test_keras_runs_on_the_launcher_framework(job):
    assert {(r["framework"], r["keras_backend"]) for r in job.ranks} == {(job.framework, job.framework)}


def test_fit_on_different_data_keeps_replicas_identical_and_equals_one_process_on_the_union(job):
    r0, r1 = (r["fit"] for r in job.ranks)
    assert r0["before"] != r1["before"] and r0["start"] == r1["start"]  # broadcast_state
    assert r0["moved"] > 1e-2
    assert max_abs_diff(r0["after"], r1["after"]) <= 1e-6
    for rank in (r0, r1):
        assert rank["vs_union"]["close"], rank["vs_union"]  # rtol 1e-5, atol 1e-6
    # Under Gloo the updates go by direct Gloo calls (one per dtype, no coordination round). On the torch
    # backend the first update learns on Horovod's path; on TensorFlow hvdp's op runs inside the traced step
    # from the first, the ranks comparing their gradients' layout at each call. Under MPI every update takes
    # Horovod's path (torch counts them; TensorFlow's reducer has no direct path there).
    if job.controller == "gloo":
        want = {"direct": 2, "horovod": 1, "changes": 0} if job.framework == "torch" else \
            {"direct": 3, "horovod": 0, "differed": 0}
        assert [r0["path"], r1["path"]] == [want, want]
        if job.framework == "torch":  # the worker lowered the threshold: both direct updates by shared memory
            assert [r0["shared memory calls"], r1["shared memory calls"]] == [2, 2]
    elif job.framework == "torch":
        want = {"direct": 0, "horovod": 3, "changes": 0}
        assert [r0["path"], r1["path"]] == [want, want]
    else:
        assert r0["path"] is None and r1["path"] is None


def test_callbacks_broadcast_average_metrics_and_warm_up(job):
    r0, r1 = (rank["callbacks"] for rank in job.ranks)
    assert r0["before"] != r1["before"] and r0["after"] == r1["after"]  # BroadcastInitialState
    # fit's logs are the ranks' already when a user's callback reads them (test_keras_peers.py: equal to one
    # process on the union), and MetricAverage after it leaves them as they are: no second average
    assert r0["history"] == r1["history"] == r0["seen_losses"] == r1["seen_losses"]
    lr = r0["lr"]  # LearningRateWarmup over 2 epochs of 4 batches, from 0.2 / 2 to 0.2
    assert lr[0] == pytest.approx(0.1) and lr[4] == pytest.approx(0.15) and lr[-1] == pytest.approx(0.2)
    assert all(b >= a for a, b in zip(lr, lr[1:])) and r0["final_lr"] == pytest.approx(0.2)


def test_learning_rate_schedule_and_warmup_correct_momentum_and_equal_one_process(job):
    """Warm-up over epoch 0 (0.05 -> 0.1 by batch), then 0.1 * 0.5 ** epoch: every rank sets the same rates,
    the momentum buffers scale by new / old rate at each change (and not without the correction), and the
    replicas equal one process with the same callbacks on the union of the batches."""
    want = [0.05, 0.0625, 0.075, 0.0875, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025]
    for rank in job.ranks:
        got = rank["schedules"]
        assert got["lr"] == pytest.approx(want), got["lr"]
        for seen, corrected in ((got["seen"], True), (got["seen_plain"], False)):
            for before, after in zip(seen[1::2], seen[2::2]):  # a batch's end, the next batch's begin
                assert (before[0], after[0]) == ("end", "begin")
                ratio = after[1] / before[1] if corrected else 1.0
                assert after[2] == pytest.approx(before[2] * ratio, rel=1e-5), (before, after)
        assert got["vs_union"]["close"], got["vs_union"]
        assert got["correction_changes"] > 1e-4, "momentum correction changed nothing"
        refused = got["refusals"]
        assert refused["steps"].startswith("ValueError: hvdp.keras.LearningRateWarmup: steps_per_epoch=0")
        assert refused["end"].startswith("ValueError: hvdp.keras.LearningRateSchedule: end_epoch=2 is not after")
        assert refused["multiplier"].startswith("TypeError: hvdp.keras.LearningRateSchedule: multiplier='half'")
    assert len({r["schedules"]["digest"] for r in job.ranks}) == 1, "replicas differ"


def test_sync_batch_normalization_equals_one_process_on_the_union(job):
    """hvdp.keras.SyncBatchNormalization: the batch statistics of every rank's examples, so fit equals one
    process with keras.layers.BatchNormalization on the union (weights and moving statistics)."""
    for rank in job.ranks:
        got = rank["sync_batch_norm"]
        assert got["weights"]["close"], got["weights"]
        assert got["stats"]["close"], got["stats"]
        assert got["moved_stats"] > 1e-2, "the moving statistics did not move"
        assert got["facade"] == ("SyncBatchNormalization" if job.framework == "tensorflow" else None)
        assert got["refused"].startswith("ValueError: hvdp.keras.SyncBatchNormalization synchronizes through")
    assert len({r["sync_batch_norm"]["digest"] for r in job.ranks}) == 1, "replicas differ"


def test_mixed_precision_with_a_loss_scale_optimizer_steps_and_skips_alike(job):
    """mixed_float16 with hvdp.DistributedOptimizer(LossScaleOptimizer(SGD)): gradients reduced before the
    overflow check, so fit equals one process on the union (float16 rounding aside), and a batch that
    overflows on rank 1 only is skipped by every rank, halving the scale alike; the other order is refused
    (its check would run on each rank's own gradients, and one rank could skip while the others wait)."""
    for rank in job.ranks:
        got = rank["mixed_precision"]
        assert got["compute_dtype"] == "float16"
        assert got["moved"] > 1e-2 and got["vs_union"]["max_abs"] <= 1e-4, got["vs_union"]  # measured 8e-6
        assert got["overflow"] == {"unchanged": True, "scale": 32768.0 / 2}, got["overflow"]
        assert got["inner_refused"].startswith("ValueError: keras.optimizers.LossScaleOptimizer(hvdp.Distributed")
        assert "hvdp.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))" in got["inner_refused"]
    for key in ("digest", "overflow_digest"):
        assert len({r["mixed_precision"][key] for r in job.ranks}) == 1, f"replicas differ ({key})"


def test_model_checkpoint_saves_on_rank_0_only(job):
    r0, r1 = (rank["schedules"] for rank in job.ranks)
    assert (r0["saves"], r1["saves"]) == (3, 0)
    assert r0["files"] == r1["files"] == ["ckpt-1.weights.h5", "ckpt-2.weights.h5", "ckpt-3.weights.h5"]
    assert r0["restored_equal"] and r1["restored_equal"]  # the last file holds the trained replica


def test_model_save_and_keras_load_model_resume_distributed_as_if_never_stopped(job):
    """Keras's resume path (model.save on rank 0, keras.models.load_model on every rank): the loaded
    optimizer still averages, and one more epoch equals an uninterrupted run (was: a plain Adam, the
    replicas 1.8e-2 apart on TensorFlow, 2.4e-2 on torch)."""
    for rank in job.ranks:
        resumed = rank["resume"]
        assert resumed["class"] == "Adam" and resumed["distributed"], resumed
        assert resumed["iterations"] == 6, resumed  # 3 steps saved, 3 after loading
        assert resumed["vs_uninterrupted"]["close"], resumed["vs_uninterrupted"]
        assert resumed["vs_uninterrupted"]["max_abs"] <= 1e-6, resumed["vs_uninterrupted"]
    assert len({r["resume"]["digest"] for r in job.ranks}) == 1, "replicas differ after resuming"


def test_backup_and_restore_resumes_a_stopped_fit_as_if_never_stopped(job):
    """keras.callbacks.BackupAndRestore (each replica its own backup): a fit stopped after epoch 1,
    then a new model's fit restores weights and optimizer state and runs epoch 2 only, averaging."""
    for rank in job.ranks:
        restored = rank["resume"]["backup"]
        assert restored["iterations"] == 6, restored  # 3 steps before the stop, 3 after
        assert restored["moved"] > 1e-3, restored  # epoch 2 did train
        assert restored["vs_uninterrupted"]["max_abs"] <= 1e-6, restored["vs_uninterrupted"]
    assert len({r["resume"]["backup"]["digest"] for r in job.ranks}) == 1, "replicas differ after restoring"


def test_a_model_built_on_one_rank_only_does_not_stall_the_next_fit(job):
    """Rank 0 builds a helper model first, so its Keras layer names differ from rank 1's; the
    gradients' collectives are named by the optimizer's number, so fit trains at once (was: TensorFlow
    waited the whole stall timeout, then failed naming tensors that differed by those layer names)."""
    names = [rank["helper"]["first_layer"] for rank in job.ranks]
    assert names[0] != names[1], names  # the names really differ between the ranks
    for rank in job.ranks:
        assert rank["helper"]["seconds"] < 60, rank["helper"]
    assert len({r["helper"]["digest"] for r in job.ranks}) == 1, "replicas differ"


def test_fit_runs_the_drift_guard_and_stops_replicas_that_start_apart(job):
    for rank in job.ranks:
        raised = rank["drift"]["raised"]
        assert raised and "Replicas drifted apart by step 1" in raised, rank["drift"]
        assert "rank 1 (2 of 4 parameters differ" in raised, raised  # the kernels; the zero-initialized biases agree
        assert "hvdp.broadcast_state(model, optimizer)" in raised


def test_the_guard_checks_an_eager_custom_loop_too(job):
    """optimizer.apply in an eager custom loop (GradientTape; torch autograd): replicas started apart
    are stopped after step 1; started equal, the loop runs its 3 steps."""
    for rank in job.ranks:
        loop = rank["custom_loop"]
        assert loop["no_broadcast"]["steps"] == 0, loop
        assert "Replicas drifted apart by step 1" in loop["no_broadcast"]["raised"], loop
        assert loop["broadcast"] == {"raised": None, "steps": 3}, loop


def test_join_around_fit_trains_uneven_batches_with_ddp_join_meaning(job):
    """Rank 0 has 5 batches an epoch, rank 1 four (2 epochs): the ranks join at each epoch's end,
    the replicas end equal (weights and Adam state, 10 iterations), equal to one process in which
    the rank that ran out adds zero-weight samples, and the metrics averaged after the join agree."""
    reports = [rank["uneven"] for rank in job.ranks]
    for result in reports:
        assert result["iterations"] == 10, result  # rank 1 stepped 8 times: it took rank 0's state
        assert result["vs_reference"]["close"], result["vs_reference"]
    assert len({r["digest"] for r in reports}) == 1, "weights or optimizer state differ"
    assert reports[0]["loss"] == reports[1]["loss"]


# shard_optimizer_state=True with Keras optimizers (ZeRO stage 1): tests/parallel/workers/_keras_sharded.py.
SHARDED = ("adam", "adamw", "sgd_momentum_schedule", "rmsprop_global_clipnorm", "adam_clipnorm")


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_keras_state_steps_as_one_process_and_each_rank_keeps_its_part(job, name):
    """fit from different weights per rank (broadcast_state), each rank's own batches: the weights and the
    whole state gathered from the ranks' parts equal one process on the union of the batches (rtol 1e-5),
    and each rank holds its part of the 143 elements' slots (72 + 71: an uneven split)."""
    slots = {"adam": 2, "adamw": 2, "adam_clipnorm": 2, "sgd_momentum_schedule": 1, "rmsprop_global_clipnorm": 1}[name]
    parts = []
    for rank in job.ranks:
        got = rank["sharded"]["equivalence"][name]
        assert got["moved"] > 1e-2, got
        assert got["vs_one_process"]["close"], got["vs_one_process"]
        assert got["state_vs_one_process"]["close"] and got["state_shapes_equal"], got
        assert got["iterations"] == 3 and got["class"] == {"sgd_momentum_schedule": "SGD", "adamw": "AdamW",
                                                          "rmsprop_global_clipnorm": "RMSprop"}.get(name, "Adam")
        parts.append(got["part_elements"])
        if "clipnorm" in name:  # clipping acted (without it the step differs), over whole variables
            assert got["unclipped_differs_by"] > 1e-3, got
    own = job.ranks[0]["sharded"]["equivalence"][name]["whole_elements"] - 143 * slots  # iterations, rate
    assert [p - own for p in parts] == [72 * slots, 71 * slots], parts
    assert len({r["sharded"]["equivalence"][name]["digest"] for r in job.ranks}) == 1, "replicas differ"


def test_sharded_keras_options_equal_the_unsharded_optimizer_and_a_custom_loop_one_process(job):
    for rank in job.ranks:
        for option in ("fp16", "bpps2", "sum"):
            assert rank["sharded"]["equivalence"][option]["max_abs"] <= 1e-6, (option, rank["sharded"]["equivalence"])
        assert rank["sharded"]["custom_loop"]["vs_one_process"]["close"], rank["sharded"]["custom_loop"]
    assert len({r["sharded"]["custom_loop"]["digest"] for r in job.ranks}) == 1, "replicas differ"


def test_sharded_keras_checkpoints_hold_the_whole_state_and_load_sharded_or_not(job):
    """hvdp.save_checkpoint gathers the whole state (the unsharded optimizer's order); it loads into an
    unsharded and a sharded optimizer, each continuing as one process; an optimizer built before it is
    sharded is taken apart with its state."""
    for rank in job.ranks:
        got = rank["sharded"]["checkpoints"]
        for case in ("to_unsharded", "to_sharded"):
            assert got[case]["iterations"] == 3, got[case]
            assert got[case]["state_vs_saved"]["max_abs"] == 0.0, got[case]
            assert got[case]["continued_vs_one_process"]["close"], got[case]
        assert got["to_unsharded"]["state_elements"] == 288 and got["to_sharded"]["state_elements"] in (146, 144)
        assert got["built_before"]["state_vs_given"]["max_abs"] == 0.0, got["built_before"]
        assert got["built_before"]["part_elements"] in (146, 144)
    for case in ("to_unsharded", "to_sharded"):
        assert len({r["sharded"]["checkpoints"][case]["digest"] for r in job.ranks}) == 1, f"replicas differ ({case})"


def test_sharded_keras_saving_gathers_through_model_checkpoint_and_refuses_a_lone_model_save(job):
    for rank in job.ranks:
        got = rank["sharded"]["saving"]
        assert got["files"] == ["epoch-1.keras", "epoch-2.keras"]
        assert got["loaded_vs_whole"]["max_abs"] == 0.0 and got["loaded_weights_equal"], got
        assert got["refused"].startswith("ValueError: model.save / save_weights of a model whose optimizer is sharded "
                                         "over 2 ranks"), got["refused"]
        assert "hvdp.save_checkpoint(path, model, optimizer)" in got["refused"]
        refused = rank["sharded"]["refusals"]
        assert refused["lamb"].startswith("ValueError: hvdp.DistributedOptimizer(shard_optimizer_state=True) takes "
                                          "Keras's elementwise optimizers"), refused
        assert "LossScaleOptimizer" in refused["loss_scale"] and "use_ema=True" in refused["ema"], refused
        assert "pass model.trainable_variables" in refused["other_variables"], refused


def test_a_keras_checkpoint_of_2_sharded_ranks_loads_at_3_and_continues_as_one_process(tmp_path_factory):
    """Saved by the torch-backend Gloo job's sharded Adam at np=2 (72 + 71 elements a slot), loaded at np=3
    (48 + 48 + 47) and continued one epoch: one process continuing from the same file on the union."""
    saved = keras_job("torch", "gloo", tmp_path_factory).out_dir / "keras_sharded.ckpt"
    ran = run_worker("keras_sharded_resume.py", "gloo", "torch", tmp_path_factory.mktemp("keras_resume"), np_=3,
                     extra_env={"HVDP_SHARDED_CHECKPOINT": str(saved)})
    found = [rank["resume"] for rank in ran.ranks]
    for rank in found:
        assert rank["loaded_iterations"] == 3 and rank["moved"] > 1e-2, rank
        assert rank["vs_one_process"]["close"], rank["vs_one_process"]
    assert [rank["part_elements"] for rank in found] == [2 * 48 + 2, 2 * 48 + 2, 2 * 47 + 2], found
    assert len({rank["digest"] for rank in found}) == 1, "replicas differ"

"""The full API, proven equivalent to one process stepping on the whole batch (np=2, Gloo and MPI,
torch and TensorFlow/Keras 3; SGD with momentum at np=3 and, torch, at 6 on 2 cores too). Each rank
computes the single-process reference itself and reports its comparison; the tests check every rank's
report and that the ranks agree with each other."""

from __future__ import annotations

import pytest
from harness import run_worker

CONFIGS = [f"{model}/{opt}" for model in ("mlp", "cnn") for opt in ("sgd", "adam")]


_JOBS: dict = {}


def equivalence_job(framework, controller, tmp_path_factory):
    """One job per (framework, controller), shared by every test of this module."""
    if (framework, controller) not in _JOBS:
        out_dir = tmp_path_factory.mktemp(framework)
        ran = run_worker(f"equivalence_{framework}.py", controller, framework, out_dir)
        ran.controller, ran.framework, ran.out_dir = controller, framework, out_dir
        _JOBS[framework, controller] = ran
    return _JOBS[framework, controller]


@pytest.fixture(scope="module", params=[(f, c) for f in ("torch", "tensorflow") for c in ("gloo", "mpi")],
                ids=lambda p: "-".join(p))
def job(request, tmp_path_factory):
    return equivalence_job(*request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def torch_job(request, tmp_path_factory):
    return equivalence_job("torch", request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def tf_job(request, tmp_path_factory):
    return equivalence_job("tensorflow", request.param, tmp_path_factory)


def results(job, key):
    return [rank["equivalence"][key] for rank in job.ranks]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("option", ["average", "sum", "bpps2", "predivide", "groups2"])
def test_matches_single_process_within_rtol_1e5_atol_1e6(job, config, option):
    for result in results(job, f"{config}/{option}"):
        assert result["moved"] > 1e-2, "training did not move the parameters"
        assert result["close"], f"{config}/{option}: max abs diff {result['max_abs']}"
    assert len({r["digest"] for r in results(job, f"{config}/{option}")}) == 1, "replicas differ"


@pytest.mark.parametrize("config", CONFIGS)
def test_fp16_compression_stays_within_1e3_of_uncompressed(job, config):
    for result in results(job, f"{config}/fp16_vs_uncompressed"):
        assert 0 < result["relative_l2"] <= 1e-3, result
        if config.endswith("sgd"):
            assert result["max_abs"] <= 1e-3, result
    assert len({r["digest"] for r in results(job, f"{config}/fp16")}) == 1, "replicas differ"


@pytest.mark.parametrize("config", CONFIGS)
def test_adasum_runs_on_mpi_and_is_refused_with_the_fix_on_gloo(job, config):
    found = results(job, f"{config}/adasum")
    if job.controller == "mpi":
        assert all("error" not in r and r["moved"] > 1e-3 for r in found), found
        assert len({r["digest"] for r in found}) == 1, "replicas differ"
    else:
        assert all("needs Horovod's MPI controller" in r["error"] and "hvdp run --mpi" in r["error"] for r in found)


@pytest.mark.parametrize("framework, np_", [("torch", 3), ("torch", 6), ("tensorflow", 3)])
def test_sgd_momentum_matches_single_process_within_1e6_at_3_and_oversubscribed_6_ranks(
        framework, np_, tmp_path_factory):
    """Beyond np=2, where a + b is exact in either order: 3 ranks, and 6 on 2 cores (Gloo; TensorFlow at 3 only:
    6 of its processes took 30-77 s here). Slices of the 64-example batch differ by one example (22/21/21,
    11/.../10); the reference averages the slices' losses. Measured: max abs 1.5e-8 to 6e-8, every rank alike."""
    ran = run_worker(f"equivalence_{framework}.py", "gloo", framework, tmp_path_factory.mktemp(f"np{np_}"), np_=np_,
                     extra_env={"HVDP_EQUIVALENCE_ONLY": "mlp/sgd/average"})
    found = [rank["equivalence"]["mlp/sgd/average"] for rank in ran.ranks]
    assert [rank["size"] for rank in ran.ranks] == [np_] * np_
    for result in found:
        assert result["moved"] > 1e-2, "training did not move the parameters"
        assert result["max_abs"] <= 1e-6, result
    assert len({r["digest"] for r in found}) == 1, "replicas differ"


def test_distributed_gradient_tape_matches_single_process(tf_job):
    for config in CONFIGS:
        assert all(r["close"] for r in results(tf_job, f"{config}/tape")), config


def test_check_consistency_names_the_perturbed_rank_on_every_rank(job):
    for rank in job.ranks:
        message = rank["consistency"]["raised"]
        assert message and message.startswith("Replicas differ from rank 0 on rank(s) 1:"), message
        assert "1 of 4 parameters differ" in message
        # How far: the elements rank 1 moved, by what it added (a step, not rounding).
        assert ", against rank 0: rank 1: " in message and "by at most 0.001 (" in message
        assert "rounding size" not in message


def test_collectives_return_the_kind_they_were_given(job):
    expected = {"allgather_tensor": [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], "allgather_numpy": [0, 1],
                "allgather_number": [0, 10], "broadcast_tensor": [1.0, 1.0, 1.0], "broadcast_number": 7,
                "broadcast_object": {"from": 1}, "allgather_object": [["rank", 0], ["rank", 1]], "barrier": True}
    for rank in job.ranks:
        assert rank["collectives"] == expected


def test_bad_input_gets_clear_errors_on_every_rank(job):
    accepted = "torch.optim.Optimizer" if job.framework == "torch" else "keras.optimizers.Optimizer"
    for rank in job.ranks:
        bad = rank["bad_input"]
        assert bad["optimizer_type"]["type"] == "TypeError" and accepted in bad["optimizer_type"]["message"]
        assert bad["unknown_op"]["type"] == "ValueError"
        assert "Expected one of: average, sum, adasum" in bad["unknown_op"]["message"]
        assert "Expected one of: none, fp16" in bad["unknown_compression"]["message"]
        assert bad["bf16"]["message"].startswith("compression='bf16': Horovod 0.28.1's wire has no bfloat16 type")
        assert "Use compression='fp16'" in bad["bf16"]["message"]
        assert (bad["groups_zero"]["type"], bad["groups_kind"]["type"]) == ("ValueError", "TypeError")
        assert bad["groups_zero"]["message"].startswith("groups=0; give the number of requests")
        assert "groups=[[w1, b1], [w2, b2]]" in bad["groups_kind"]["message"]
        if job.framework == "tensorflow":
            assert bad["groups_lists_keras"]["type"] == "TypeError"
            assert "a Keras optimizer's come as one list" in bad["groups_lists_keras"]["message"]
        for case, shapes in (("shape_mismatch", "rank 0: float32[3], rank 1: float32[4]"),
                             ("dtype_mismatch", "rank 0: float32[3], rank 1: float64[3]")):
            assert bad[case]["type"] == "TensorMismatchError", bad[case]
            assert shapes in bad[case]["message"] and "grad." in bad[case]["message"]
            assert bad[case]["seconds"] < 30
        if job.framework == "torch":
            assert bad["tape_on_torch"]["type"] == "FrameworkError"
        else:  # a Keras layer on TensorFlow, which takes no num_features
            assert bad["sync_batch_norm_on_tf"]["type"] == "TypeError"
            assert "is a Keras layer, which learns its features" in bad["sync_batch_norm_on_tf"]["message"]
        if job.framework == "tensorflow":
            assert bad["convert_on_tf"]["type"] == "FrameworkError"
            assert "hvdp.convert_sync_batchnorm is for torch" in bad["convert_on_tf"]["message"]
        assert bad["after_errors"] == 2.0  # the job goes on after the errors


def test_torch_sparse_gradients_missing_gradients_and_sync_batch_norm(torch_job):
    job = torch_job
    for rank in job.ranks:
        for key in ("sparse", "sparse_as_dense", "groups_lists"):  # rows gathered, reduced dense, one group
            assert rank[key]["close"], (key, rank[key])
        assert rank["sparse_groups_refused"].startswith("ValueError: hvdp.DistributedOptimizer(groups=...): the model")
        assert "Pass sparse_as_dense=True too" in rank["sparse_groups_refused"]
        assert rank["sync_batch_norm"]["params"]["close"] and rank["sync_batch_norm"]["running_stats"]["close"]
        assert rank["sync_batch_norm"]["eval"]["close"], "SyncBatchNorm in eval mode (CPU)"
        converted = rank["sync_batch_norm"]["converted"]
        assert converted["params"]["close"] and converted["running_stats"]["close"], converted
        assert converted["same_model"] and converted["alone"] == "SyncBatchNorm"
        assert converted["classes"] == ["Sequential", "Conv2d", "Sequential", "SyncBatchNorm", "ReLU", "Flatten",
                                        "SyncBatchNorm", "Linear"]
        assert converted["kept"] == {"weight_object": True, "running_mean": [2.0] * 4, "momentum": 0.3,
                                     "training": False, "affine_off": True}
        assert converted["forward"] == [2, 2]
        assert rank["missing_grads"]["seconds"] < 30
    for key in ("sparse", "sparse_as_dense", "groups_lists"):
        assert len({r[key]["digest"] for r in job.ranks}) == 1, key
    assert len({r["missing_grads"]["digest"] for r in job.ranks}) == 1


@pytest.mark.parametrize("form", ["clip", "horovod_sum", "amp", "no_sync"])
def test_torch_step_forms_see_averaged_gradients_when_backward_returns(torch_job, form):
    """DDP's step forms (clip after backward, AMP's unscale_, no_sync accumulation) and Horovod's
    synchronize()/skip_synchronize() form with op="sum" (a second reduction would double it)."""
    reports = [rank["step_forms"][form] for rank in torch_job.ranks]
    for result in reports:
        assert result["close"], f"{form}: max abs diff to one process {result['max_abs']}"
        if form != "no_sync":  # clipping was active, on the global norm one process sees
            assert min(result["ref_norms"]) > 0.1, result["ref_norms"]
            assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-5)
    assert len({r["digest"] for r in reports}) == 1, "replicas differ"
    # Every rank holds the same (averaged) gradients as soon as backward() returns...
    assert [r["grads"] for r in reports[1:]] == [reports[0]["grads"]] * (len(reports) - 1)
    if form == "no_sync":  # ...but inside no_sync() each rank keeps its own
        assert all(a != b for a, b in zip(reports[0]["local"], reports[1]["local"]))


def test_torch_drift_guard_stops_replicas_that_part_naming_step_ranks_and_causes(torch_job):
    for rank in torch_job.ranks:
        guard = rank["drift_guard"]
        # No broadcast_state: different start, caught after step 1 (the step never returns).
        assert guard["no_broadcast"]["steps"] == 0, guard
        assert "by step 1" in guard["no_broadcast"]["raised"]
        assert "rank 1 (4 of 4 parameters differ, e.g. 0.weight, 0.bias, 2.weight)" in guard["no_broadcast"]["raised"]
        assert "hvdp.broadcast_state(model, optimizer)" in guard["no_broadcast"]["raised"]
        assert "HVDP_CHECK_EVERY" in guard["no_broadcast"]["raised"]
        # One rank changes a parameter after step 2: caught at step 4 (every 2), naming that parameter.
        assert guard["rank_only_update"]["steps"] == 3, guard
        assert "by step 4" in guard["rank_only_update"]["raised"]
        assert "rank 1 (1 of 4 parameters differ, e.g. 2.bias)" in guard["rank_only_update"]["raised"]
        # Off: the same drift trains on (what check_every=0 asks for).
        assert guard["off"] == {"raised": None, "steps": 5}


def test_torch_join_trains_uneven_batches_with_ddp_join_meaning_and_ends_equal(torch_job):
    """Rank 0 has 5 batches, rank 1 four: inside hvdp.join the last step averages rank 0's gradient
    with rank 1's zeros over size() (DDP's Join), every rank ends with rank 0's model, buffers and
    Adam state, and the job exits 0 (without join it fails naming the counts: test_core)."""
    reports = [rank["uneven"] for rank in torch_job.ranks]
    for result in reports:
        assert result["last_rank"] == 0 and result["adam_steps"] == 5, result
        assert result["vs_reference"]["close"], result["vs_reference"]
        assert result["vs_mean_of_stepping"]["max_abs"] > 1e-4, "the two meanings must be told apart"
    assert len({r["digest"] for r in reports}) == 1, "parameters, buffers or optimizer state differ"


def test_torch_buffers_are_rank_0s_before_each_training_forward_unless_turned_off(torch_job):
    kept_equal = {rank["buffers"]["True"] for rank in torch_job.ranks}
    per_rank = {rank["buffers"]["False"] for rank in torch_job.ranks}
    assert len(kept_equal) == 1, "broadcast_buffers=True (the default): running statistics differ"
    assert len(per_rank) == len(torch_job.ranks), "broadcast_buffers=False: each rank should keep its own"


# shard_optimizer_state=True (ZeRO stage 1), torch: tests/parallel/workers/_sharded.py.

SHARDED_OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")


def sharded(job, key):
    return [rank["sharded"][key] for rank in job.ranks]


@pytest.mark.parametrize("optimizer", SHARDED_OPTIMIZERS)
@pytest.mark.parametrize("option", ["average", "sum", "bpps2", "predivide"])
def test_sharded_state_steps_as_one_process_on_the_whole_batch(torch_job, optimizer, option):
    """From different weights on each rank through broadcast_state, two param groups with their own lr, a
    StepLR schedule, a flat buffer that divides by 2 unevenly: within rtol 1e-5 of one process."""
    found = [rank[f"{optimizer}/{option}"] for rank in sharded(torch_job, "equivalence")]
    for result in found:
        assert result["moved"] > 1e-2, "training did not move the parameters"
        assert result["close"], f"{optimizer}/{option}: max abs diff {result['max_abs']}"
        assert result["lrs"] == found[0]["lrs"] and result["lrs"][0] != result["lrs"][1], result["lrs"]
    assert len({r["digest"] for r in found}) == 1, "replicas differ"


@pytest.mark.parametrize("optimizer", SHARDED_OPTIMIZERS)
def test_sharded_state_is_each_ranks_part_and_gathers_to_the_single_process_state(torch_job, optimizer):
    found = [rank[f"{optimizer}/average"] for rank in sharded(torch_job, "equivalence")]
    slots = 2 if optimizer.startswith("adam") else 1  # Adam's two moments; a momentum or square average
    assert sum(r["state_elements"] for r in found) == slots * found[0]["whole_elements"], found
    for result in found:  # each rank's share: half, give or take one element per param group and slot
        assert abs(result["state_elements"] - slots * result["whole_elements"] / 2) <= 2 * slots, result
        assert result["state_max_abs"] <= 1e-6, result  # state_dict() gathers the whole, as torch's


@pytest.mark.parametrize("optimizer", SHARDED_OPTIMIZERS)
def test_sharded_fp16_compression_equals_the_unsharded_optimizers(torch_job, optimizer):
    for result in (rank[f"{optimizer}/fp16"] for rank in sharded(torch_job, "equivalence")):
        assert result["fp16_vs_unsharded"]["max_abs"] <= 1e-6, result
        assert 0 < result["relative_l2"] <= 1e-2, result


def test_sharded_clip_grad_norm_clips_the_global_gradient(torch_job):
    for result in sharded(torch_job, "equivalence"):
        clip = result["clip"]
        assert clip["close"], clip
        assert max(abs(a - b) for a, b in zip(clip["norms"], clip["ref_norms"])) <= 1e-5 * max(clip["ref_norms"])
        assert min(clip["norms"]) > 0.05, "the norms must exceed max_norm for the check to clip"


def test_sharded_checkpoints_load_unsharded_and_back_and_continue_as_one_process(torch_job):
    for rank in sharded(torch_job, "checkpoints"):
        for case in ("sharded_to_whole", "whole_to_sharded", "sharded_to_sharded", "state_dict_to_one_process"):
            assert rank[case]["close"] and rank[case]["extras"] == {"step": 5}, (case, rank[case])
        assert rank["state_dict_to_one_process"]["steps"] == [10], rank["state_dict_to_one_process"]
        assert rank["sharded_to_whole"]["state_elements"] > rank["whole_to_sharded"]["state_elements"] * 1.9


def test_sharded_state_takes_amp_grad_scaler_and_every_rank_skips_an_overflow_alike(torch_job):
    """GradScaler.unscale_ reduce-scatters first, and the ranks agree on its found-inf flags: an inf in rank 1's
    last-layer gradient (seen by the part's owner only) is skipped by every rank, each halving its scale, and the
    sharded run ends where the unsharded one does (without the agreement the ranks part: the job hangs)."""
    for rank in sharded(torch_job, "grad_scaler"):
        assert rank["max_abs"] <= 1e-6, rank
        assert rank["skipped"] == [True, True], rank
        assert rank["scales"][0] == rank["scales"][1] == [65536.0] + [32768.0] * 4, rank
    assert len({rank["digest"] for rank in sharded(torch_job, "grad_scaler")}) == 1, "replicas differ"


def test_sharded_refusals_name_the_value_and_the_fix(torch_job):
    for rank in sharded(torch_job, "refusals"):
        assert rank["lbfgs"].startswith("ValueError") and "LBFGS" in rank["lbfgs"] and "Fix:" in rank["lbfgs"]
        assert "op='adasum'" in rank["adasum"] and "op='average'" in rank["adasum"]
        assert "groups=2" in rank["groups"] and "Leave groups out" in rank["groups"]
        assert rank["not_bool"].startswith("TypeError") and "'yes'" in rank["not_bool"]
        assert "float64" in rank["mixed_dtypes"] and "param group of their own" in rank["mixed_dtypes"]
        assert "0.weight" in rank["moved_parameter"] and "make the optimizer" in rank["moved_parameter"]
        assert "hvdp.join()" in rank["join"] and "shard_optimizer_state=False" in rank["join"]
        assert rank["after"] == 2.0


@pytest.mark.parametrize("ranks", [3, 1])
def test_a_checkpoint_of_2_sharded_ranks_loads_at_3_or_1_and_continues_as_one_process(tmp_path_factory, ranks):
    """Saved by the Gloo equivalence job's sharded Adam at np=2, loaded at np=3 (a new split) and at np=1
    (one part: the whole buffer, no collectives in the step)."""
    saved = equivalence_job("torch", "gloo", tmp_path_factory).out_dir / "adam_sharded.ckpt"
    ran = run_worker("sharded_resume.py", "gloo", "torch", tmp_path_factory.mktemp(f"resume{ranks}"), np_=ranks,
                     extra_env={"HVDP_SHARDED_CHECKPOINT": str(saved)})
    found = [rank["resume"] for rank in ran.ranks]
    for result in found:
        assert result["close"] and result["moved"] > 1e-3, result
        assert result["extras"] == {"step": 5} and result["loaded_steps"] == [5], result
        assert abs(result["state_elements"] - 2 * result["whole_elements"] / ranks) <= 4, result
    assert sum(r["state_elements"] for r in found) == 2 * found[0]["whole_elements"]
    assert len({r["digest"] for r in found}) == 1, "replicas differ"


def test_sharded_backward_sends_each_bucket_as_its_gradients_are_ready(torch_job):
    """Three buckets: all sent by the hooks before backward returns. With a layer forward never uses, its
    bucket goes at the end of the pass, and the run still steps as one process."""
    found = sharded(torch_job, "overlap")
    for rank in found:
        assert rank["early"] == {"buckets": 3, "pending": 3, "early": 3}, rank["early"]
        unused = rank["unused"]
        assert unused["close"] and unused["buckets"] == 3 and unused["early"] == [2] * 5, unused
        assert rank["after"] == 2.0
    assert len({rank["unused"]["digest"] for rank in found}) == 1, "replicas differ"


@pytest.mark.parametrize("case", ["extra_pass", "no_sync"])
def test_sharded_two_backward_passes_a_step_reduce_their_sum(torch_job, case):
    """backward_passes_per_step=1 and two passes (the first's reduction is dropped, the second reduces the sum);
    or the first inside no_sync(): as one process on the two halves' summed loss."""
    found = [rank[case] for rank in sharded(torch_job, "overlap")]
    for result in found:
        assert result["close"], result
    assert len({r["digest"] for r in found}) == 1, "replicas differ"


def test_sharded_step_refuses_a_grad_changed_after_backward_and_loses_nothing(torch_job):
    for rank in sharded(torch_job, "overlap"):
        changed = rank["changed"]
        assert changed["clip"].startswith("RuntimeError") and "changed in place" in changed["clip"], changed
        assert "opt.clip_grad_norm_(max_norm)" in changed["clip"], changed
        assert "2.bias.grad was replaced" in changed["replaced"], changed
        assert changed["unchanged"] and changed["moved"] > 1e-4, changed

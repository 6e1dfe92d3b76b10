"""Core API under horovodrun -np 2, for both controllers and both frameworks.

One job per (controller, framework) runs every check of that framework and each
rank reports what it saw; the assertions compare the ranks' reports.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import max_abs_diff, run_worker

CONTROLLERS = ["gloo", "mpi"]
#: Replicas are identical, bit for bit (the drift guard demands it); JSON keeps a float64 exactly.
TOLERANCE = 0.0


@pytest.fixture(scope="module", params=CONTROLLERS)
def torch_job(request, tmp_path_factory):
    return run_worker("core_torch.py", request.param, "torch", tmp_path_factory.mktemp("torch"))


@pytest.fixture(scope="module", params=CONTROLLERS)
def tf_job(request, tmp_path_factory):
    return run_worker("core_tensorflow.py", request.param, "tensorflow", tmp_path_factory.mktemp("tf"))


def check_topology(ranks):
    for r in ranks:
        assert r["size"] == 2 and r["local_size"] == 2
        assert r["local_rank"] == r["rank"]
        assert r["cross_size"] == 1 and r["cross_rank"] == 0


def check_identical_after(ranks, before_key, after_key):
    r0, r1 = ranks
    assert max_abs_diff(r0[before_key], r1[before_key]) > 1e-3, "ranks did not start different"
    assert max_abs_diff(r0[after_key], r1[after_key]) <= TOLERANCE


def test_torch_topology_and_framework(torch_job):
    check_topology(torch_job.ranks)
    assert {r["framework"] for r in torch_job.ranks} == {"torch"}


def test_torch_broadcast_state_makes_parameters_and_adam_state_identical(torch_job):
    check_identical_after(torch_job.ranks, "before_broadcast", "after_broadcast")
    check_identical_after(torch_job.ranks, "adam_before", "adam_after")
    assert len(torch_job.ranks[0]["adam_after"]) > 0


def test_torch_training_on_different_data_keeps_replicas_identical(torch_job):
    r0, r1 = torch_job.ranks
    assert r0["losses"] != r1["losses"], "ranks saw the same data"
    assert max_abs_diff(r0["params_after_broadcast"], r0["after_training"]) > 1e-3, "training changed nothing"
    assert max_abs_diff(r0["after_training"], r1["after_training"]) <= TOLERANCE
    assert r0["optimizer_class"] == "SGD"


def test_torch_allreduce_returns_the_kind_it_was_given(torch_job):
    for r in torch_job.ranks:
        assert r["allreduce_number"] == pytest.approx(1.5)
        assert r["allreduce_sum_int"] == 3 and isinstance(r["allreduce_sum_int"], int)
        assert r["allreduce_numpy"] == pytest.approx([0.5, 0.5, 0.5])


def check_elementwise(ranks, int_dtype):
    """min, max and product on every kind of value, against NumPy over both ranks' inputs."""
    for r in ranks:
        assert set(r["elementwise"]) == {"min", "max", "product"}
        for op, got in r["elementwise"].items():
            assert got["tensor_error"] <= 1e-6 and got["numpy_error"] <= 1e-6, (op, got)
            assert got["ints_exact"] and got["ints_dtype"] == int_dtype, (op, got)
            assert (got["number"], got["number_type"]) == (got["number_expected"], "int"), (op, got)
        assert [r["elementwise"][op]["number"] for op in ("min", "max", "product")] == [2, 3, 6]


def check_scatter(ranks):
    """reducescatter and alltoall against NumPy over both ranks' inputs, and their refusals."""
    for r in ranks:
        got = r["scatter"]
        for op in ("sum", "average"):
            part = got[f"reducescatter_{op}"]
            assert part["shape"] == part["want_shape"] == [3 - r["rank"], 3], part  # 5 rows: 3 to rank 0, 2 to rank 1
            assert part["tensor_error"] <= 1e-5 and part["numpy_error"] <= 1e-5, part
            assert part["numpy_kind"] == "ndarray"
        assert got["alltoall_equal"]
        routed = got["alltoall_splits"]
        assert routed["rows"] and routed["counts"] == routed["want_counts"], routed
        refused = got["refusals"]
        assert refused["op"].startswith("ValueError: hvdp.reducescatter(op='max'): Horovod's reducescatter averages")
        assert refused["number"].startswith("TypeError: hvdp.reducescatter splits its value's first dimension")
        assert refused["uneven"].startswith("ValueError: hvdp.alltoall: 5 rows do not divide into 2 equal parts")
        assert "splits=[3, 2]" in refused["uneven"]
        assert "sends 2 rows, but the value has 3" in refused["splits_sum"]
        assert "has 1 counts for 2 ranks" in refused["splits_count"]
        assert got["after"] == 2


N_EXAMPLES = 11  # the workers' _data.N: one left over on 2 ranks


def dealt(order, size, drop):
    """The reference: rank r's share of ``order`` dealt in turn, completed from its start or cut to equal."""
    order = list(order)
    whole = len(order) // size * size if drop else -(-len(order) // size) * size
    padded = (order * 2)[:whole]
    return [padded[r::size] for r in range(size)]


def check_shares(shares, n, drop, copies=1):
    """Equal counts; every example ``copies`` times over the ranks but for at most size - 1 repeated or left out."""
    size = len(shares)
    assert len({len(s) for s in shares}) == 1, [len(s) for s in shares]
    counts = np.bincount(np.concatenate(shares), minlength=n)
    if drop:
        assert set(counts) <= {copies - 1, copies} and (counts == copies - 1).sum() == n * copies % size, counts
    else:
        assert set(counts) <= {copies, copies + 1} and (counts == copies + 1).sum() == -(n * copies) % size, counts


def check_sampler(ranks):
    """hvdp.DistributedSampler on every rank: equal shares that cover the epoch, one order per epoch."""
    got = [r["data"]["sampler"] for r in ranks]
    for drop in (False, True):
        key = f"drop_last_{drop}"
        for epoch in (0, 1):
            check_shares([g[key]["epochs"][epoch] for g in got], N_EXAMPLES, drop)
        assert got[0][key]["epochs"][0] != got[0][key]["epochs"][1], "set_epoch changed nothing"
        assert [(g[key]["len"], g[key]["repeated"], g[key]["left_out"]) for g in got] == \
            [(6, 1, 0) if not drop else (5, 0, 1)] * 2
    assert [g["in_order"] for g in got] == dealt(range(N_EXAMPLES), 2, False)
    assert [g["in_order_drop_last"] for g in got] == dealt(range(N_EXAMPLES), 2, True)
    for g in got:
        assert g["refusals"]["no_len"].startswith("TypeError: hvdp.DistributedSampler: range_iterator has no len()")
        assert g["refusals"]["seed"].startswith("ValueError: hvdp.DistributedSampler: seed=-1")
        assert g["refusals"]["empty"].startswith("ValueError: hvdp.DistributedSampler: 0 examples")
        assert g["refusals"]["epoch"].startswith("ValueError: hvdp.DistributedSampler.set_epoch('1')")


def test_torch_distributed_sampler_in_a_dataloader_deals_as_ddp_does(torch_job):
    check_sampler(torch_job.ranks)
    loaders = [r["data"]["loader"] for r in torch_job.ranks]
    for epoch in (0, 1):
        check_shares([g["epochs"][epoch]["ids"] for g in loaders], N_EXAMPLES, drop=False)
        assert all(g["epochs"][epoch]["rows_match_ids"] and g["epochs"][epoch]["batches"] == 3 for g in loaders)
    assert [g["epochs"][1]["ids"] for g in loaders] == [g["sampler_indices"][0] for g in loaders]
    # in order, hvdp's shares are DDP's torch.utils.data.DistributedSampler's, with and without drop_last
    got = [r["data"]["sampler"] for r in torch_job.ranks]
    assert [g["in_order"] for g in got] == [g["ddp_in_order"]["drop_last_False"] for g in loaders]
    assert [g["in_order_drop_last"] for g in got] == [g["ddp_in_order"]["drop_last_True"] for g in loaders]
    assert {g["loader_len"] for g in loaders} == {3}


def test_tensorflow_shard_dataset_gives_equal_shares_whatever_the_pipeline_order(tf_job):
    check_sampler(tf_job.ranks)
    got = [r["data"]["dataset"] for r in tf_job.ranks]
    order = got[0]["order"]
    assert all(g["order"] == order for g in got) and sorted(order) == list(range(N_EXAMPLES))
    assert [g["range"] for g in got] == dealt(range(N_EXAMPLES), 2, False)
    assert [g["range_drop"] for g in got] == dealt(range(N_EXAMPLES), 2, True)
    assert [g["pairs_ids"] for g in got] == dealt(range(N_EXAMPLES), 2, False)
    assert all(g["pairs_rows_match"] for g in got)
    assert [g["shuffled"] for g in got] == dealt(order, 2, False)
    flat = [[v for b in g["before_batch"] for v in b] for g in got]
    assert flat == dealt(order, 2, False) and [len(b) for b in got[0]["before_batch"]] == [2, 2, 2]
    # batched (and repeated) before the sharding: unbatched, dealt, batched again at its batch size
    flat = [[v for b in g["after_batch_repeat"] for v in b] for g in got]
    assert flat == dealt(order * 2, 2, False)
    check_shares(flat, N_EXAMPLES, drop=False, copies=2)
    assert [[len(b) for b in g["after_batch_repeat"]] for g in got] == [[2, 2, 2, 2, 2, 1]] * 2
    assert [g["after_batch_drop"] for g in got] == [[s[:3]] for s in dealt(order[:9], 2, False)]
    for g in got:
        assert g["refusals"]["unseeded"].startswith("ValueError: hvdp.shard_dataset: the pipeline shuffles without")
        assert "seed=42" in g["refusals"]["unseeded"]
        assert g["refusals"]["rank_seeds"].startswith("ValueError: hvdp.shard_dataset: the pipeline's shuffle seeds")
        assert "on rank 1: TensorFlow combines a shuffle's seed with the global seed" in g["refusals"]["rank_seeds"]
        assert g["refusals"]["padded"].startswith("ValueError: hvdp.shard_dataset: the pipeline has a padded_batch")
        assert g["refusals"]["not_a_dataset"].startswith("TypeError: hvdp.shard_dataset takes a tf.data.Dataset")


def check_grouped(ranks):
    """The grouped collectives on a list of a tensor, an array and numbers, against NumPy over both ranks."""
    for r in ranks:
        got = r["grouped"]
        for op in ("sum", "average", "max"):
            part = got[f"allreduce_{op}"]
            assert part["tensor_error"] <= 1e-5 and part["array_as_allreduce"], (op, part)
            assert part["array_error"] <= (1e-5 if op != "average" else 0.5), (op, part)  # int64: in its dtype
            assert part["array_kind"] == "ndarray"
            assert part["numbers"] == pytest.approx(part["want_numbers"]), (op, part)
            assert part["number_types"] == (["float", "float"] if op == "average" else ["float", "int"]), (op, part)
        assert got["allgather"]["tensor"] and got["allgather"]["array"]
        assert got["allgather"]["numbers"] == got["allgather"]["want_numbers"] == [3, 4]
        assert got["reducescatter"]["tensor_error"] <= 1e-5 and got["reducescatter"]["array_error"] <= 1e-5
        refused = got["refusals"]
        assert refused["one_value"].startswith("TypeError: hvdp.grouped_allreduce takes a non-empty list")
        assert "got float32[5]" in refused["one_value"] and "call hvdp.allreduce for one value" in refused["one_value"]
        assert refused["empty"].startswith("TypeError: hvdp.grouped_allgather takes a non-empty list")
        assert refused["adasum"].startswith("ValueError: hvdp.grouped_allreduce(op='adasum')")
        assert refused["scatter_op"].startswith("ValueError: hvdp.grouped_reducescatter(op='max')")
        assert "got float" in refused["scatter_number"]
        assert got["after"] == 2


def test_torch_grouped_collectives_match_numpy(torch_job):
    check_grouped(torch_job.ranks)


def test_tensorflow_grouped_collectives_match_numpy(tf_job):
    check_grouped(tf_job.ranks)


def test_torch_reducescatter_and_alltoall_match_numpy(torch_job):
    check_scatter(torch_job.ranks)


def test_tensorflow_reducescatter_and_alltoall_match_numpy(tf_job):
    check_scatter(tf_job.ranks)


def test_torch_elementwise_allreduce_matches_numpy_and_gradients_refuse_it(torch_job):
    check_elementwise(torch_job.ranks, "int64")
    for r in torch_job.ranks:
        refused = r["elementwise_refusals"]
        assert refused["optimizer"].startswith("ValueError: hvdp.DistributedOptimizer(op='max'): gradients are")
        assert "Use op='average', 'sum' or 'adasum'" in refused["optimizer"]
        assert refused["requires_grad"].startswith("ValueError: hvdp.allreduce(op='min') of a tensor that requires")
        assert "tensor.detach()" in refused["requires_grad"]
        assert refused["unknown"] == ("ValueError: Unknown op 'median'. "
                                      "Expected one of: average, sum, adasum, min, max, product.")


def test_tensorflow_elementwise_allreduce_matches_numpy_and_gradients_refuse_it(tf_job):
    check_elementwise(tf_job.ranks, "int64")
    for r in tf_job.ranks:
        refused = r["elementwise_refusals"]
        assert refused["optimizer"].startswith("ValueError: hvdp.DistributedOptimizer(op='product'): gradients")
        assert refused["tape"].startswith("ValueError: hvdp.DistributedGradientTape(op='max'): gradients are")


def test_tensorflow_topology_and_keras_backend(tf_job):
    check_topology(tf_job.ranks)
    assert {(r["framework"], r["keras_backend"]) for r in tf_job.ranks} == {("tensorflow", "tensorflow")}


def test_tensorflow_broadcast_state_makes_weights_and_optimizer_identical(tf_job):
    check_identical_after(tf_job.ranks, "before_broadcast", "after_broadcast")
    check_identical_after(tf_job.ranks, "adam_before", "adam_after")


def test_keras_model_fit_on_different_data_keeps_replicas_identical(tf_job):
    r0, r1 = tf_job.ranks
    assert r0["fit_data"] != r1["fit_data"], "ranks saw the same data"
    assert r0["fit_losses"] == r1["fit_losses"]  # fit's logs are the union's on every rank
    assert max_abs_diff(r0["params_after_broadcast"], r0["after_fit"]) > 1e-3, "fit changed nothing"
    assert max_abs_diff(r0["after_fit"], r1["after_fit"]) <= TOLERANCE
    assert r0["optimizer_class"] == "SGD"


def test_keras_gradient_tape_loop_keeps_replicas_identical(tf_job):
    r0, r1 = tf_job.ranks
    assert r0["loop_losses"] != r1["loop_losses"], "ranks saw the same data"
    assert max_abs_diff(r0["after_loop"], r1["after_loop"]) <= TOLERANCE


def test_tensorflow_allreduce(tf_job):
    for r in tf_job.ranks:
        assert r["allreduce_tensor"] == pytest.approx([0.5, 0.5])
        assert r["allreduce_number"] == pytest.approx(1.5)


def test_ranks_that_took_different_numbers_of_steps_fail_the_job_naming_each_count(tmp_path):
    from harness import WORKERS, run_job

    job = run_job(["--gloo", "--framework", "torch", str(WORKERS / "uneven_steps.py")], tmp_path)
    assert [r["steps"] for r in job.ranks] == [5, 4]  # both ranks got to the end of their loop
    assert job.returncode != 0, job.output[-3000:]
    line = "The ranks took different numbers of optimizer steps (rank 0: 5, rank 1: 4)"
    assert line in job.output, job.output[-3000:]
    assert "drop_remainder=True" in job.output

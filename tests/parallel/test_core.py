"""Core API under horovodrun -np 2, for both controllers and both frameworks.

One job per (controller, framework) runs every check of that framework and each
rank reports what it saw; the assertions compare the ranks' reports.
"""

from __future__ import annotations

import pytest
from harness import max_abs_diff, run_worker

CONTROLLERS = ["gloo", "mpi"]
TOLERANCE = 1e-6


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
    assert r0["fit_losses"] != r1["fit_losses"], "ranks saw the same data"
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

"""hvdp.allreduce(out=...) and the early wake of Horovod's loop, under horovodrun -np 2.

The jobs run with HOROVOD_CYCLE_TIME=200 (ms) so that the wake is unmistakable: a
blocking 4 KB allreduce, allgather or reducescatter, a gradient step or a sharded
Keras update that wakes Horovod's loop ends well inside one cycle; with
HVDP_EARLY_WAKE=0 (and HVDP_GRADIENT_PATH=horovod: torch's direct path and direct small calls skip
Horovod's loop altogether) it waits for the next round, most of a cycle. This checks behaviour,
not speed (``hvdp bench`` measures that at the default cycle).
"""

from __future__ import annotations

import pytest
from harness import run_worker

CYCLE_MS = 200
SLOW = {"HOROVOD_CYCLE_TIME": str(CYCLE_MS)}
#: Woken calls take a few ms (tens on loaded cores); unwoken ones wait for the next round.
WOKEN_MAX_MS = CYCLE_MS * 0.4
UNWOKEN_MIN_MS = CYCLE_MS * 0.6


@pytest.fixture(scope="module", params=[("torch", "gloo"), ("torch", "mpi"), ("tensorflow", "gloo")],
                ids=lambda p: "-".join(p))
def job(request, tmp_path_factory):
    framework, controller = request.param
    return run_worker("data_path.py", controller, framework, tmp_path_factory.mktemp(framework), extra_env=SLOW)


@pytest.fixture(scope="module")
def unwoken(tmp_path_factory):
    return run_worker("data_path.py", "gloo", "torch", tmp_path_factory.mktemp("unwoken"),
                      extra_env={**SLOW, "HVDP_EARLY_WAKE": "0", "HVDP_GRADIENT_PATH": "horovod"})


def test_out_holds_the_same_result_as_a_new_tensor_on_every_rank(job):
    expected_sum = [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]]
    for r in job.ranks:
        assert r["plain"] == expected_sum and r["out"] == expected_sum
        assert r["out_is_returned"] and r["value_unchanged"]
        assert r["inplace_average"] == [[0.0, 1.5, 3.0], [4.5, 6.0, 7.5]]
        assert r["numpy_out"] == r["numpy_out_written"] == [3.0] * 4
        if r["framework"] == "torch":
            assert r["leaf_out"] == [3.0] * 3


def test_bad_out_values_are_refused_with_the_fix(job):
    for r in job.ranks:
        refusals = r["refusals"]
        assert refusals["shape"].startswith("ValueError") and "float32[3, 2]" in refusals["shape"] \
            and "float32[2, 3]" in refusals["shape"] and "empty_like" in refusals["shape"]
        assert refusals["dtype"].startswith("ValueError") and "float64[2, 3]" in refusals["dtype"]
        assert refusals["number"].startswith("TypeError") and "drop out=" in refusals["number"]
        assert refusals["kind"].startswith("TypeError") and "value's kind" in refusals["kind"]
        if r["framework"] == "torch":
            assert refusals["strided"].startswith("ValueError") and "contiguous" in refusals["strided"]
        else:
            assert refusals["immutable"].startswith("TypeError") and "tf.Variable" in refusals["immutable"]


def test_blocking_allreduce_and_gradient_step_wake_horovods_loop(job):
    for r in job.ranks:
        assert r["cycle_ms"] == str(CYCLE_MS) and r["early_wake"] == "1"
        # A gradient step: torch wakes in step(); TensorFlow's gradients are one grouped allreduce.
        assert r["step_ms"] < WOKEN_MAX_MS, r
        if r["framework"] == "torch":
            assert r["allreduce_4k_ms"] < WOKEN_MAX_MS and r["allreduce_4k_out_ms"] < WOKEN_MAX_MS, r
        else:  # TensorFlow's eager allreduce blocks inside Horovod, where nothing can wake the loop
            assert r["allreduce_4k_ms"] > UNWOKEN_MIN_MS, r
            # a sharded Keras update traced: its reducescatter and allgather each wake the loop
            assert r["sharded_step_ms"] < WOKEN_MAX_MS, r
        # Horovod's own allgather and reducescatter wake the loop at their enqueue (the build's patch)
        assert r["allgather_4k_ms"] < WOKEN_MAX_MS and r["reducescatter_4k_ms"] < WOKEN_MAX_MS, r


def test_without_the_wake_the_same_calls_wait_for_the_next_round(unwoken):
    for r in unwoken.ranks:
        assert r["early_wake"] == "0"
        assert r["allreduce_4k_ms"] > UNWOKEN_MIN_MS and r["step_ms"] > UNWOKEN_MIN_MS, r
        assert r["allgather_4k_ms"] > UNWOKEN_MIN_MS and r["reducescatter_4k_ms"] > UNWOKEN_MIN_MS, r

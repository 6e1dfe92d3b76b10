"""torch's direct gradient path (fixed buckets allreduced by direct Gloo calls once the ranks agree on them,
:mod:`hvdp.backends.torch.direct.gradients`) against Horovod's negotiated path, in one np=2 job: every setting gives the
same parameters on both paths and on both ranks; a graph change on one rank is seen by every rank at the same
step, the step still right, and the next step learns again on Horovod's path; two optimizers over one
backward pass share the one sender thread. Small hvdp.allreduce calls (a direct exchange) give Horovod's
path's results, and calls that differ between ranks are refused on every rank. (A stalled rank on the
direct path: test_faults.py; ranks with different numbers of steps: test_core.py.)"""

from __future__ import annotations

import pytest
from harness import WORKERS, max_abs_diff, run_job, run_worker

CASES = ("average", "sum", "predivide", "two passes", "no_sync", "graph change", "in place", "in place, sum",
         "in place, two passes", "in place, graph change", "two lanes", "two lanes, two passes",
         "two lanes, graph change", "shared memory", "in place, shared memory", "graph change, shared memory")
STEPS, SKIP_STEP = 8, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_worker("direct_path.py", "gloo", "torch", tmp_path_factory.mktemp("direct"))


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def calls_job(request, tmp_path_factory):
    """hvdp.allreduce's direct calls: the Gloo job's (the job above), and the same cases under hvdp run --mpi
    (their MPI peer, hvdp.backends.direct_mpi)."""
    if request.param == "gloo":
        return request.getfixturevalue("job")
    return run_worker("direct_calls_mpi.py", "mpi", "torch", tmp_path_factory.mktemp("direct_mpi"))


def test_under_mpi_without_mpi4py_rank_0_says_why_once_and_the_calls_keep_horovods_path(tmp_path):
    job = run_job(["--mpi", "--framework", "torch", str(WORKERS / "direct_calls_mpi.py"), "without-mpi4py"], tmp_path)
    assert job.returncode == 0, job.why()
    said = [line for line in job.output.splitlines() if "take Horovod's path: mpi4py is not installed" in line]
    assert len(said) == 1 and "pip install 'hvdp[mpi]'" in said[0], job.output[-3000:]
    assert [r["rank"] for r in job.ranks] == [0, 1], job.why()
    for r in job.ranks:
        assert r["controller"] == "" and r["total"] == [3.0] * 4, r
        assert r["mismatch"].startswith("TensorMismatchError: "), r  # Horovod's negotiation refuses it there
        assert r["btl"] == "^openib,ofi", r  # Open MPI's OFI transport left out (a deadlock in MPI_Init)


def test_the_calls_go_direct_on_the_jobs_controller_and_only_gloos_gradients_do(calls_job, request):
    """Under MPI the calls take the MPI peer; the gradients keep Horovod's path there (its MPI allreduce)."""
    controller = request.node.callspec.params["calls_job"]
    for r in calls_job.ranks:
        assert r["controller"] == controller and r["gradients direct"] is (controller == "gloo"), r


@pytest.mark.parametrize("case", CASES)
def test_direct_path_matches_horovods_on_every_rank(job, case):
    digests = set()
    for r in job.ranks:
        direct, horovod = r["cases"][case]["direct"], r["cases"][case]["horovod"]
        assert max_abs_diff(direct["params"], horovod["params"]) <= 1e-5, (r["rank"], case)
        # the switch: Horovod's path only, every step
        assert (horovod["path"], horovod["modes"]) == ("horovod", ["horovod"] * STEPS), (r["rank"], case)
        assert horovod["counts"] == {"direct": 0, "horovod": STEPS, "changes": 0}, (r["rank"], case)
        assert direct["path"] == "direct", (r["rank"], case)
        digests.add(direct["digest"])
        # one bucket gathering every gradient; or the two hidden weights in place (in the order backward makes
        # them) and the rest gathered last; or two small gathered buckets, on the two sender lanes
        if case.startswith("two lanes"):
            assert direct["buckets"] == [False, False] and direct["lanes"] == [0, 1], (case, direct["lanes"])
        else:
            assert direct["buckets"] == ([True, True, False] if case.startswith("in place") else [False]), case
            assert set(direct["lanes"]) == {0}, (case, direct["lanes"])  # in-place buckets, and gathered bucket 0 or 2
        if "graph change" not in case:  # one learning step on Horovod's path, then the direct path to the end
            assert direct["modes"] == ["direct"] * STEPS, (r["rank"], case, direct["modes"])
            assert direct["counts"] == {"direct": STEPS - 1, "horovod": 1, "changes": 0}, (r["rank"], case)
            # Horovod's loop quiet from the first direct step on (never on Horovod's path)
            assert direct["quiet"] == [False] + [True] * (STEPS - 1), (r["rank"], case, direct["quiet"])
        assert horovod["quiet"] == [False] * STEPS, (r["rank"], case)
        # a collective on Horovod's path right after the direct steps: its loop quiet, the submitted tensor wakes it
        assert direct["big"] == [3.0, 3.0] and direct["quiet after big"] is True, case
    assert len(digests) == 1, f"{case}: the replicas differ"


@pytest.mark.parametrize("case", ["graph change", "in place, graph change", "two lanes, graph change"])
def test_graph_change_on_one_rank_is_seen_by_every_rank_and_learnt_again(job, case):
    """Rank 1 skips the middle layer at step 3: both ranks count the change there, take Horovod's path for
    step 4 (learning), and are back on the direct path from step 5 (the skipped weight gathered, or in place)."""
    for r in job.ranks:
        direct = r["cases"][case]["direct"]
        want = ["direct"] * STEPS
        want[SKIP_STEP] = "learn"  # the mode after the step: learn the order again
        assert direct["modes"] == want, (r["rank"], direct["modes"])
        # quiet from the first direct step, off for the learning step after the change, on again after it
        quiet = [step not in (0, SKIP_STEP, SKIP_STEP + 1) for step in range(STEPS)]
        assert direct["quiet"] == quiet, (r["rank"], direct["quiet"])
        assert direct["counts"] == {"direct": STEPS - 2, "horovod": 2, "changes": 1}, r["rank"]


def test_two_optimizers_over_one_backward_pass(job):
    digests = set()
    for r in job.ranks:
        direct, horovod = r["two optimizers"]["direct"], r["two optimizers"]["horovod"]
        assert max_abs_diff(direct["params"], horovod["params"]) <= 1e-5, r["rank"]
        assert direct["counts"] == [{"direct": STEPS - 1, "horovod": 1, "changes": 0}] * 2
        digests.add(direct["digest"])
    assert len(digests) == 1


@pytest.mark.parametrize("key", ["float32 sum", "float32 average", "float64 sum", "float64 average", "int32 sum",
                                 "int64 sum"])
def test_small_allreduce_matches_horovods_path_on_every_rank(calls_job, key):
    for r in calls_job.ranks:
        got = r["calls"][key]
        assert got["shape"] == [2, 3] and got["dtype"] == "torch." + key.split()[0]
        assert max_abs_diff(sum(got["direct"], []), sum(got["horovod"], [])) <= 1e-6, (r["rank"], key, got)
    assert calls_job.ranks[0]["calls"][key]["direct"] == calls_job.ranks[1]["calls"][key]["direct"]


def test_small_allreduce_numpy_out_and_numbers(calls_job):
    for r in calls_job.ranks:
        assert r["calls"]["numpy out="] == {"returned_out": True, "out": [4.5, 7.5]}
        assert r["calls"]["numbers"] == [2.5, 5]


@pytest.mark.parametrize("what", ["name", "shape", "dtype"])
def test_calls_that_differ_between_ranks_are_refused_on_every_rank(calls_job, what):
    """Differing names are refused too (Horovod's path would wait for the other name); differing sizes, which
    would end a Gloo collective's process, come back as an error, and the next call works."""
    for r in calls_job.ranks:
        refusal = r["calls"]["refusals"][what]
        assert refusal.startswith("TensorMismatchError: "), (r["rank"], refusal)
        assert "rank 0: " in refusal and "rank 1: " in refusal, refusal
        assert r["calls"]["refusals"][f"after {what}"] == 8.0  # 4 ones on each of 2 ranks


LARGE_KEYS = ("float32 sum", "float32 average", "float64 sum", "float64 average", "int32 sum", "int64 sum")


@pytest.mark.parametrize("key", LARGE_KEYS)
def test_large_allreduce_by_the_ring_matches_horovods_path_on_every_rank(calls_job, key):
    for r in calls_job.ranks:
        got = r["large calls"][key]
        assert got["shape"] == [300, 257] and got["dtype"] == "torch." + key.split()[0], got
        assert got["diff"] <= (1e-4 if "32" in key else 1e-9), (r["rank"], key, got)
    assert calls_job.ranks[0]["large calls"][key]["digest"] == calls_job.ranks[1]["large calls"][key]["digest"]


def test_large_allreduce_into_out_in_place_numpy_and_transposed(calls_job):
    for r in calls_job.ranks:
        got = r["large calls"]
        assert got["out="] == {"returned_out": True, "right": True, "input unchanged": True}, got["out="]
        assert got["in place"] == {"returned_out": True, "right": True}
        assert got["numpy out="] == {"returned_out": True, "right": True}
        assert got["transposed"] == {"right": True}
        # every large call took the ring (the six dtypes/ops, out=, in place, NumPy, transposed, the calls after
        # each refusal), none of the refused ones (their header exchange refused them first)
        assert got["ring calls"] == 6 + 4 + 3, got["ring calls"]


@pytest.mark.parametrize("what", ["name", "shape", "dtype"])
def test_large_calls_that_differ_between_ranks_are_refused_before_the_ring(calls_job, what):
    for r in calls_job.ranks:
        refusal = r["large calls"]["refusals"][what]
        assert refusal.startswith("TensorMismatchError: "), (r["rank"], refusal)
        assert "rank 0: " in refusal and "rank 1: " in refusal, refusal
        assert r["large calls"]["refusals"][f"after {what}"] == 140_000.0


def test_buckets_go_through_shared_memory_from_its_threshold_and_by_the_ring_below_it(job):
    """Buckets of 512 KB and more go through shared memory (every rank on this machine); the cases with the
    threshold lowered to 1 byte sent every direct step's buckets that way, and gave Horovod's path's result
    (test_direct_path_matches_horovods_on_every_rank); the model's own buckets, all far below 512 KB, never."""
    for r in job.ranks:
        for case in CASES:
            direct = r["cases"][case]["direct"]
            calls = direct["shared memory calls"]
            if "shared memory" in case:
                assert calls >= direct["counts"]["direct"] * len(direct["buckets"]) > 0, (case, calls, direct["counts"])
            else:
                assert calls == 0, (case, calls)


SHM_KEYS = ("float32 sum", "float32 average", "float64 sum", "int32 sum", "int64 sum")


@pytest.mark.parametrize("key", SHM_KEYS)
def test_allreduce_through_shared_memory_matches_horovods_path_on_every_rank(calls_job, key):
    for r in calls_job.ranks:
        got = r["shared memory"][key]
        assert got["dtype"] == "torch." + key.split()[0] and got["numel"] > (8 << 20) // 4, got
        assert got["diff"] <= (1e-4 if "32" in key else 1e-9), (r["rank"], key, got)


def test_shared_memory_into_out_and_in_place_and_every_call_went_through_it(calls_job):
    for r in calls_job.ranks:
        got = r["shared memory"]
        assert got["out="] == {"returned_out": True, "right": True, "input unchanged": True}, got["out="]
        assert got["in place"] == {"returned_out": True, "right": True}
        assert got["served"] == 5 + 2, got  # the five dtypes/ops, out=, in place (Horovod's path: its own)
        assert got["ring, switched off"] is True
        assert got["ring calls"] == 1, got  # only the call with shared memory switched off


def test_shared_memory_refuses_sizes_that_differ_and_falls_back_to_the_ring_without_memory(calls_job):
    for r in calls_job.ranks:
        got = r["shared memory"]
        assert got["sizes differ"].startswith("HorovodInternalError: Mismatched direct allreduce"), got
        assert "every rank's bytes: [8392608, 8396704]" in got["sizes differ"], got["sizes differ"]
        assert got["after the refusal"] == 2.0 * ((8 << 20) // 4 + 1000)
        # rank 1 could not make its file: both ranks keep Gloo's ring on that channel, with the right sum
        assert got["memory refused"] == {"right": True, "ring only": True, "served": 0}, got["memory refused"]
        assert got["files left"] == [], got["files left"]
        assert "HVDP_SHARED_MEMORY='yes'" in got["setting refused"] and "0 (Gloo's ring" in got["setting refused"]


def test_the_quiet_loop_setting_is_read_and_refused_with_the_fix(job):
    for r in job.ranks:
        setting = r["quiet setting"]
        assert setting["unset"] == 50 and setting["zero"] == 0, setting
        assert "HVDP_QUIET_LOOP_MS='fast'" in setting["refused"] and "0 to keep" in setting["refused"], setting
        assert setting["quiet with a 50 ms cycle"] is False  # the loop's rounds never come more often

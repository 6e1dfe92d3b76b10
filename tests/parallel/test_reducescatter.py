"""Horovod's Gloo reducescatter as hvdp's build makes it (one alltoallv and a local sum, buffers kept from call to
call: :data:`hvdp.horovod_build.patches.GLOO_REDUCESCATTER`), at np=3, where a rank sums more than two blocks
and some ranks receive no rows; and hvdp.allreduce past 256 KB, Gloo's ring from an input apart from its output
(:data:`hvdp.horovod_build.direct_patches.GLOO_RING_FROM_INPUT`), where np=3 forwards reduced segments, and
past 8 MB through shared memory (:mod:`hvdp.backends.torch.direct.shm`), three places summed per segment. One
torch job checks every case; what every rank reports is asserted."""

from __future__ import annotations

import pytest
from harness import run_worker

#: Largest error, relative to the largest expected value, per dtype (float16 rounds each partial sum).
TOLERANCE = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "int32": 0.0, "int64": 0.0}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_worker("reducescatter_cases.py", "gloo", "torch", tmp_path_factory.mktemp("rs"), np_=3)


def test_every_case_matches_numpy_on_every_rank(job):
    for r in job.ranks:
        assert r["size"] == 3
        cases = r["cases"]
        assert len(cases) == 5 * 5 + 4 + 5, sorted(cases)
        for name, got in cases.items():
            dtype = name.split()[1]
            assert got["shape"][0] == got["want_rows"], (r["rank"], name, got)
            assert got["error"] <= TOLERANCE[dtype], (r["rank"], name, got)
            assert got["input_kept"], (r["rank"], name, "the input tensor was changed")


def test_ranks_with_no_rows_take_part(job):
    """1 row over 3 ranks: rank 0 gets it, ranks 1 and 2 get none, and the job went on to the next case."""
    rows = [r["cases"]["lone float32 1 rows"]["shape"][0] for r in job.ranks]
    assert rows == [1, 0, 0]
    assert [r["cases"]["group float32 0 rows"]["shape"][0] for r in job.ranks] == [0, 0, 0]


@pytest.mark.parametrize("way", ["ring", "shared memory"])
def test_the_ring_from_an_input_apart_and_shared_memory_sum_like_numpy_on_every_rank(job, way):
    for r in job.ranks:
        ring = r[way]
        # every large call took its way: 3 dtypes x new, out=, in place
        calls = {"ring calls": 9 if way == "ring" else 0, "shared memory calls": 0 if way == "ring" else 9}
        assert {k: ring[k] for k in calls} == calls, ring
        for dtype in ("float32", "float64", "int64"):
            for form in ("new", "out=", "in place"):
                got = ring[f"{form} {dtype}"]
                assert got["error"] <= TOLERANCE[dtype], (r["rank"], form, dtype, got)
                assert got["input_kept"], (r["rank"], dtype, "out= changed the input")

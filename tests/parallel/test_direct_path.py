"""torch's direct gradient path (fixed buckets allreduced by direct Gloo calls once the ranks agree on them,
:mod:`hvdp.backends.torch_direct`) against Horovod's negotiated path, in one np=2 job: every setting gives the
same parameters on both paths and on both ranks; a graph change on one rank is seen by every rank at the same
step, the step still right, and the next step learns again on Horovod's path; a rank that stops ends the
other's step with a message within Gloo's timeout."""

from __future__ import annotations

import pytest
from harness import max_abs_diff, run_worker

CASES = ("average", "sum", "predivide", "two passes", "no_sync", "graph change")
STEPS, SKIP_STEP = 8, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_worker("direct_path.py", "gloo", "torch", tmp_path_factory.mktemp("direct"),
                      extra_env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "8"})


@pytest.mark.parametrize("case", CASES)
def test_direct_path_matches_horovods_on_every_rank(job, case):
    digests = set()
    for r in job.ranks:
        direct, horovod = r["cases"][case]["direct"], r["cases"][case]["horovod"]
        assert max_abs_diff(direct["params"], horovod["params"]) <= 1e-5, (r["rank"], case)
        assert horovod["counts"] is None and horovod["modes"] == [None] * STEPS  # the switch: Horovod's path only
        digests.add(direct["digest"])
        if case != "graph change":  # one learning step on Horovod's path, then the direct path to the end
            assert direct["modes"] == ["direct"] * STEPS, (r["rank"], case, direct["modes"])
            assert direct["counts"] == {"direct": STEPS - 1, "horovod": 1, "changes": 0}, (r["rank"], case)
            assert direct["buckets"] == 1
    assert len(digests) == 1, f"{case}: the replicas differ"


def test_graph_change_on_one_rank_is_seen_by_every_rank_and_learnt_again(job):
    """Rank 1 skips the middle layer at step 3: both ranks count the change there, take Horovod's path for
    step 4 (learning), and are back on the direct path from step 5."""
    for r in job.ranks:
        direct = r["cases"]["graph change"]["direct"]
        want = ["direct"] * STEPS
        want[SKIP_STEP] = "learn"  # the mode after the step: learn the order again
        assert direct["modes"] == want, (r["rank"], direct["modes"])
        assert direct["counts"] == {"direct": STEPS - 2, "horovod": 2, "changes": 1}, r["rank"]


def test_a_rank_that_stops_ends_the_others_step_with_a_message(job):
    ranks = {r["rank"]: r["stopping"] for r in job.ranks}
    assert ranks[1]["raised"] is None
    assert ranks[0]["raised"] == "HorovodInternalError", ranks[0]
    assert "direct gradient allreduce of bucket 1 of 1 failed" in ranks[0]["message"]
    assert "HVDP_GRADIENT_PATH=horovod" in ranks[0]["message"]
    assert ranks[0]["seconds"] < 8 + 20, ranks[0]  # Gloo's timeout (8 s here), not a hang

"""Shut down and initialize again, many times in one job (np=2, torch, Gloo), with the direct path in use.

Each hvd.init() on Gloo meets the other ranks through the launcher's rendezvous store. Before
hvdp.horovod_build.patches.RENDEZVOUS_CLEARED, a scope of that store could keep the addresses of a past start,
and an init after a shutdown then connected to a closed port: SIGABRT inside hvd.init() within the first
rounds of this job (init, barrier, shutdown in a loop failed at rounds 2 and 5 of 30).
"""

from __future__ import annotations

from harness import run_worker

ROUNDS = 20


def test_every_rank_reports_every_round_of_shutdown_and_init_again(tmp_path):
    job = run_worker("reinit.py", "gloo", "torch", tmp_path, extra_env={"HVDP_REINIT_ROUNDS": str(ROUNDS)})
    by_rank = {report["rank"]: report for report in job.ranks}
    for rank, report in by_rank.items():
        assert [r["round"] for r in report["rounds"]] == list(range(ROUNDS)), (rank, job.why())
        assert report["initialized_after"] is False, rank
        for r in report["rounds"]:
            where = (rank, r["round"])
            assert r["rank"] == rank, where
            assert r["small"] == 1.0 + 2 * r["round"], where  # (0 + round) + (1 + round)
            assert r["large"] == [3.0, 3.0], where            # 1 + 2, every element
            assert r["in_set"] == rank + 1.0, where           # each set holds one rank: its own value
            assert r["counts"] == {"direct": 2, "horovod": 1, "changes": 0}, where  # 1 step learns, 2 go direct
    for round_ in range(ROUNDS):
        digests = {by_rank[rank]["rounds"][round_]["params"] for rank in by_rank}
        assert len(digests) == 1, f"round {round_}: the replicas differ after their steps"

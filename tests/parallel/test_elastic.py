"""Elastic training (hvdp.elastic under hvdp run --elastic): 2 workers -> 1 -> 2 on this machine.

The discovery script prints a file the job changes: two names of this machine, one slot
each, so Horovod blacklists only the killed worker's "host". A worker is killed with
SIGKILL mid-epoch; training goes on alone from the last commit; the host is listed again
and, after Horovod's blacklist cooldown, a new worker joins with rank 0's state.
"""

from __future__ import annotations

import pytest
from harness import WORKERS, run_job, run_worker

FRAMEWORKS = ["torch", "tensorflow"]
EPOCHS, BATCHES = 4, 8  # as in workers/elastic_train.py


def run_elastic(framework, model, tmp_path):
    (tmp_path / "hosts").write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text('#!/bin/sh\ncat "$(dirname "$0")/hosts"\n')
    discover.chmod(0o755)
    return run_job(["--elastic", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
                    "--blacklist-cooldown-range", "1", "2", "--framework", framework,
                    str(WORKERS / "elastic_train.py"), model], tmp_path, np_=2, timeout=240)


@pytest.mark.parametrize("framework, model", [("torch", "torch"), ("tensorflow", "keras"), ("torch", "keras-sharded"),
                                              ("torch", "sharded"), ("tensorflow", "keras-sharded")])
def test_kill_one_of_two_workers_train_alone_then_re_add_it(framework, model, tmp_path):
    job = run_elastic(framework, model, tmp_path)
    assert job.returncode == 0, job.output[-6000:]
    assert [r["rank"] for r in job.ranks] == [0, 1], job.output[-4000:]
    first, joined = job.ranks
    killed_at = float((tmp_path / "killed").read_text().split()[0])

    # Rank 0 ran throughout; rank 1 is the worker that joined (the first rank 1 was killed).
    assert first["first_incarnation"] and not joined["first_incarnation"]
    assert first["sizes"] == [2, 1, 2] and joined["sizes"] == [2]
    assert first["resets"] == [1, 2] and joined["resets"] == []
    # Restarts: rank 0 went back to its last commit (step 12; the kill came at step 13) and
    # came back at step 20 with the new worker, which took rank 0's state at step 20.
    assert first["starts"] == [[0, 2], [12, 1], [20, 2]] and joined["starts"] == [[20, 2]]

    for rank in job.ranks:  # all epochs completed, each batch counted once
        assert (rank["epoch"], rank["step"], rank["size"]) == (EPOCHS, EPOCHS * BATCHES, 2)
        commits = rank["commits"]
        assert commits == sorted(commits), f"the committed step went backwards: {commits}"
        assert commits[-1] == EPOCHS * BATCHES
    assert joined["commits"][0] >= first["commits"][first["commits"].index(20)]
    assert first["final"] == joined["final"] and first["max_abs_diff"] == joined["max_abs_diff"] == 0.0
    if model != "keras":
        # Adam's state went back to the commit with the model (step 12, not 13) and, sharded, was split
        # again at each change of workers: every counter in the whole state is the 32 steps taken.
        assert first["adam_steps"] == joined["adam_steps"] == [float(EPOCHS * BATCHES)], (first, joined)
        whole = 8 * 16 + 16 + 16 * 3 + 3  # the model's parameters (workers/_parts.py)
        parts = [first["adam_elements"], joined["adam_elements"]]
        assert parts == ([whole // 2 + 1, whole // 2] if "sharded" in model else [whole, whole]), parts
    if model == "keras-sharded":  # a sharded optimizer outside the State, stepped after the change: refused
        assert first["unmanaged"] == ("ValueError: hvdp.DistributedOptimizer(shard_optimizer_state=True) laid out "
                                      "its state over 2 workers, and the job has 1 now. Fix: hold the model and "
                                      "optimizer in an hvdp.elastic.State and train in a function decorated with "
                                      "hvdp.elastic.run, which lays the state out again over the new workers."), first
    if (framework, model) == ("tensorflow", "keras-sharded"):
        # A step traced at np=2 and run at np=1 is refused before it changes anything (the counters above).
        assert first["stale"].startswith("InvalidArgumentError: "), first["stale"]
        assert ("[hvdp.DistributedOptimizer(shard_optimizer_state=True): this step was compiled (tf.function) "
                "before the workers of the job changed, for the old layout of the optimizer state. Fix: make the "
                "tf.function inside the function hvdp.elastic.run decorates") in first["stale"], first["stale"]

    events = dict((name, when) for name, when in first["events"] if name != "first step at size 2")
    resumed = events["first step at size 1"] - killed_at
    rejoined = [when for name, when in first["events"] if name == "first step at size 2"][-1] - events["readd"]
    print(f"\n{framework}/{model}: kill -> training at np=1 in {resumed:.2f} s; host listed again -> np=2 in "
          f"{rejoined:.2f} s; commits of rank 0: {first['commits']}")
    assert 0 < resumed < 30 and 0 < rejoined < 60


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_state_syncs_from_rank_0_restores_the_last_commit_and_refuses_misuse(framework, tmp_path):
    job = run_worker("elastic_state.py", "gloo", framework, tmp_path)
    origin = job.ranks[0]["before"]
    for rank in job.ranks:
        assert rank["differed"]  # the ranks started from different parameters
        assert rank["synced"]["params"] == origin
        assert (rank["synced"]["epoch"], rank["synced"]["note"], rank["synced"]["history"]) == (0, "from rank 0", [0])
        assert rank["restored"] == {"equal_to_commit": True, "changed_before": True, "epoch": 0, "history": [0]}
        assert rank["after_commit"] == {"params_kept": True, "epoch": 3}
        assert rank["returned"] == "done"
        refusals = rank["refusals"]
        assert refusals["not_a_state"].startswith("TypeError: @hvdp.elastic.run: the first argument of check() "
                                                  "must be an hvdp.elastic.State, got dict.")
        assert refusals["reserved_extra"] == ("ValueError: hvdp.elastic.State: extra(s) 'commit' would hide "
                                              "State's own attributes; rename them (e.g. commit_value).")
        assert refusals["before_init"].startswith("NotInitializedError: hvdp.elastic.State() was called before "
                                                  "hvdp.init().")
    assert job.ranks[0]["synced"] == job.ranks[1]["synced"] and job.ranks[0]["final"] == job.ranks[1]["final"]

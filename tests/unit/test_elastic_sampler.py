"""hvdp.elastic.Sampler's bookkeeping, with the workers of a job played in one process.

Each simulated worker holds its own copy of the sampler, as the ranks of a job do; a commit
is a deep copy, a failure goes back to it, and a change of workers hands every worker rank
0's copy (what State.sync does). The real 3 -> 2 -> 3 job is tests/parallel/test_elastic_sampler_job.py.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest

from hvdp.data import plan_batches
from hvdp.elastic import Sampler


def test_plan_batches_keeps_every_example_once_and_no_worker_empty():
    for n in range(1, 40):
        for size in (1, 2, 3, 4):
            plan = plan_batches(np.arange(n), 3, size)
            assert sorted(np.concatenate(plan).tolist()) == list(range(n))
            if n >= size:
                assert all(len(batch[r::size]) >= 1 for batch in plan for r in range(size))


def run_steps(samplers, epoch, steps):
    """Every worker takes ``steps`` steps (or the rest of the epoch); the trained indices, per step."""
    size = len(samplers)
    streams = [s._batches(epoch, rank, size) for rank, s in enumerate(samplers)]
    trained = []
    for _ in range(steps):
        parts = [next(stream, None) for stream in streams]
        if parts[0] is None:
            assert all(p is None for p in parts), "workers took different numbers of steps"
            break
        assert all(len(p) >= 1 for p in parts)
        trained.append(np.concatenate(parts).tolist())
    return trained


def test_three_two_three_workers_train_each_example_once_per_epoch():
    n, batch = 101, 4
    epoch_counts = []
    committed = Sampler(n, batch, seed=5)
    for epoch in range(2):
        workers = [copy.deepcopy(committed) for _ in range(3)]
        kept = []
        kept += run_steps(workers, epoch, 3)
        committed = copy.deepcopy(workers[0])  # commit after 3 steps
        lost = run_steps(workers, epoch, 2)  # 2 more steps, then worker 2 dies: they are undone
        assert lost
        workers = [copy.deepcopy(committed) for _ in range(2)]  # restore, 2 workers left
        kept += run_steps(workers, epoch, 4)
        committed = copy.deepcopy(workers[0])  # a commit sees a new host: 3 workers, synced from rank 0
        workers = [copy.deepcopy(committed) for _ in range(3)]
        kept += run_steps(workers, epoch, 10_000)
        committed = copy.deepcopy(workers[0])
        counts = Counter(i for step in kept for i in step)
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}, epoch
        assert committed.trained() == n
        epoch_counts.append(len(counts))
    assert epoch_counts == [n, n]


def test_epochs_reshuffle_and_bad_arguments_are_refused():
    sampler = Sampler(50, 5, seed=1)
    first = np.concatenate(list(sampler._batches(0, 0, 1)))
    second = np.concatenate(list(sampler._batches(1, 0, 1)))
    assert sorted(first) == sorted(second) == list(range(50)) and first.tolist() != second.tolist()
    unshuffled = np.concatenate(list(Sampler(6, 2, shuffle=False)._batches(0, 1, 2)))
    assert unshuffled.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match=r"batch_size=0; give the examples per worker per step"):
        Sampler(10, 0)
    with pytest.raises(ValueError, match=r"n_examples=0; expected an integer >= 1"):
        Sampler(0, 2)

"""hvdp.elastic.Sampler under `hvdp run --elastic`: 3 -> 2 -> 3 workers in the middle of an epoch,
and still every example trained exactly once per epoch (torch, and Keras on TensorFlow).

The two jobs run side by side (harness.side_by_side): each mostly waits, for its worker to be blacklisted,
its host's cooldown and the discovery script's next listing; nothing here is timed."""

from __future__ import annotations

import functools
import socket
from collections import Counter

import pytest
from harness import WORKERS, run_job, side_by_side

N, EPOCHS = 240, 3  # as in workers/elastic_sampler.py
CASES = [("torch", "torch"), ("tensorflow", "keras")]


def sampler_job(framework, model, tmp_path):
    (tmp_path / "hosts").write_text(f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text('#!/bin/sh\ncat "$(dirname "$0")/hosts"\n')
    discover.chmod(0o755)
    return run_job(["--elastic", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discover),
                    "--blacklist-cooldown-range", "1", "2", "--framework", framework,
                    str(WORKERS / "elastic_sampler.py"), model], tmp_path, np_=3, timeout=400)


@pytest.fixture(scope="module")
def sampler_jobs(tmp_path_factory):
    return side_by_side({case: functools.partial(sampler_job, *case, tmp_path_factory.mktemp(f"sampler-{case[0]}"))
                       for case in CASES})


@pytest.mark.parametrize("framework, model", CASES)
def test_three_two_three_workers_train_every_example_once_per_epoch(framework, model, sampler_jobs):
    """Over 60 s: the first case runs both jobs (3 workers each, one leaving and joining again)."""
    job = sampler_jobs[(framework, model)].result()
    assert job.returncode == 0, job.output[-6000:]
    assert [r["rank"] for r in job.ranks] == [0, 1, 2], job.output[-4000:]
    assert [r["first_incarnation"] for r in job.ranks] == [True, True, False]  # rank 2 is the one that joined
    log = job.ranks[0]["log"]
    assert all(rank["log"] == log for rank in job.ranks)  # every worker ends with the same record
    table = []
    for epoch in range(EPOCHS):
        steps = [(size, indices) for e, size, indices in log if e == epoch]
        counts = Counter(i for _, indices in steps for i in indices)
        assert sorted(counts) == list(range(N)), f"epoch {epoch}: missing {sorted(set(range(N)) - set(counts))}"
        assert set(counts.values()) == {1}, f"epoch {epoch}: twice {[i for i, c in counts.items() if c > 1]}"
        sizes = [size for size, _ in steps]
        runs = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
        by_size = Counter()
        for size, indices in steps:
            by_size[size] += len(indices)
        table.append((epoch, runs, dict(by_size), len(counts), sum(counts.values())))
    assert table[1][1] == [3, 2, 3], table  # the middle epoch went 3 -> 2 -> 3 workers
    # hvdp.DistributedSampler deals to the workers present: at 3 workers 80 each, at 2 workers 120 each,
    # every example in one share
    shares = job.ranks[0]["shares"]
    assert [(epoch, size) for epoch, size, _, _ in shares] == [(0, 3), (1, 3), (1, 2), (1, 3), (2, 3)], shares
    for epoch, size, length, parts in shares:
        assert length == N // size and [len(part) for part in parts] == [N // size] * size, (epoch, size)
        assert sorted(i for part in parts for i in part) == list(range(N)), (epoch, size)
    assert table[0][1] == [3] and table[2][1] == [3]
    print(f"\n{framework}/{model}: (epoch, workers over the epoch, examples per size, distinct, total)")
    for row in table:
        print("  ", row)

"""One bucket planner (hvdp.backends.torch.buckets) for both bucketed paths: the direct gradient path cuts the
order backward made the gradients in, the sharded optimizer each param group's buffer from its last parameter;
given the same gradients in the same order, both cut them alike."""

from __future__ import annotations

import random

import pytest
import torch

from hvdp.backends.torch import buckets as planner
from hvdp.backends.torch import sharded_buckets
from hvdp.backends.torch.direct import buckets as direct_buckets


@pytest.fixture
def small_bounds(monkeypatch):
    monkeypatch.setattr(planner, "FIRST", 40)
    monkeypatch.setattr(planner, "BUCKET", 70)


@pytest.mark.parametrize("seed", range(20))
def test_the_direct_path_and_the_sharded_optimizer_cut_the_same_gradients_alike(small_bounds, seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 30) for _ in range(rng.randint(1, 15))]  # a group's parameters, buffer order
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    backward = list(reversed(params))  # the order backward makes their gradients
    index = {id(p): i for i, p in enumerate(params)}
    direct = [[index[id(p)] for p in run] for run, in_place in direct_buckets.cut(backward, big=1 << 30)
              if run and not in_place]
    sharded = [list(bucket.params) for bucket in reversed(sharded_buckets.plan([sizes]))]
    assert [sorted(run) for run in direct] == sharded, (sizes, direct, sharded)


@pytest.mark.parametrize("seed", range(20))
def test_every_bucket_but_the_last_reaches_its_bound_and_none_goes_past_it_by_more_than_one_gradient(
        small_bounds, seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 30) for _ in range(rng.randint(1, 25))]
    filler: planner.Filler[int] = planner.Filler()
    runs = [run for i, n in enumerate(sizes) if (run := filler.add(i, n)) is not None]
    rest = filler.rest()
    assert [i for run in runs + [rest] for i in run] == list(range(len(sizes)))  # every gradient once, in order
    for k, run in enumerate(runs):
        bound = planner.FIRST if k == 0 else planner.BUCKET
        held = sum(sizes[i] for i in run)
        assert held >= bound and held - sizes[run[-1]] < bound, (k, run, held, bound)
    assert sum(sizes[i] for i in rest) < (planner.FIRST if not runs else planner.BUCKET)


def test_large_gradients_go_alone_in_place_and_the_last_bucket_is_always_a_gathered_one(small_bounds):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 500, 20, 600)]
    index = {id(p): i for i, p in enumerate(params)}
    cut = direct_buckets.cut(params, big=100)
    assert [([index[id(p)] for p in run], in_place) for run, in_place in cut] == \
        [([1], True), ([3], True), ([0, 2], False)]
    alone = direct_buckets.cut(params[1:2], big=100)
    assert alone[-1] == ([], False)  # the pass's counts travel in a gathered bucket of their own

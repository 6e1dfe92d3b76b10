"""hvdp.data.shard_indices: the rules every rank relies on to take the same number of steps; and
hvdp.DistributedSampler: every rank's indices are DDP's sampler's."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hvdp.data import ddp_order, shard_indices


@pytest.mark.parametrize("n, size", [(10, 2), (11, 2), (1797, 3), (7, 8)])
def test_shards_have_equal_length_and_cover_the_data(n, size):
    shards = [shard_indices(n, r, size, seed=3, epoch=1) for r in range(size)]
    assert len({len(s) for s in shards}) == 1
    assert set(np.concatenate(shards)) == set(range(n))
    assert sum(len(s) for s in shards) - n == (-n) % size  # only the padding repeats


def test_drop_remainder_gives_disjoint_shards_without_padding():
    shards = [shard_indices(11, r, 3, drop_remainder=True) for r in range(3)]
    flat = np.concatenate(shards)
    assert len(flat) == 9 and len(set(flat)) == 9


def test_epochs_reshuffle_and_seeds_repeat():
    a = shard_indices(100, 0, 2, seed=1, epoch=0)
    assert not np.array_equal(a, shard_indices(100, 0, 2, seed=1, epoch=1))
    assert np.array_equal(a, shard_indices(100, 0, 2, seed=1, epoch=0))
    assert shard_indices(6, 1, 2, shuffle=False).tolist() == [1, 3, 5]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="n_examples="):
        shard_indices(bad, 0, 2)


def test_drop_remainder_with_too_little_data_is_refused():
    with pytest.raises(ValueError, match="fewer than size"):
        shard_indices(3, 0, 4, drop_remainder=True)


# hvdp.DistributedSampler deals DDP's order: every rank's indices are torch.utils.data.DistributedSampler's.

#: (examples, ranks): fewer examples than ranks, divisible and not, one rank, and the DDP tutorial's 2048.
DEALS = [(1, 2), (3, 4), (3, 8), (7, 8), (10, 2), (11, 2), (11, 3), (12, 4), (97, 5), (2048, 2), (5, 1)]


def ddps_shares(n, size, **options):
    """torch's DistributedSampler on every rank: each rank's indices."""
    from torch.utils.data import DistributedSampler as DDPSampler

    shares = []
    for rank in range(size):
        sampler = DDPSampler(range(n), num_replicas=size, rank=rank, shuffle=options["shuffle"],
                             seed=options["seed"], drop_last=options["drop_last"])
        sampler.set_epoch(options["epoch"])
        shares.append((list(sampler), len(sampler)))
    return shares


def hvdps_shares(n, size, monkeypatch, **options):
    """hvdp.DistributedSampler on every rank, the rank and size of a job or process set played here."""
    import hvdp.data

    shares = []
    for rank in range(size):
        monkeypatch.setattr(hvdp.data, "world", lambda process_set, caller, rank=rank: (rank, size))
        sampler = hvdp.data.DistributedSampler(n, shuffle=options["shuffle"], seed=options["seed"],
                                               drop_last=options["drop_last"])
        sampler.set_epoch(options["epoch"])
        shares.append((list(sampler), len(sampler)))
        assert sampler.repeated + n == len(sampler) * size or options["drop_last"]
        assert n - sampler.left_out == len(sampler) * size or not options["drop_last"]
    return shares


@pytest.mark.parametrize("n, size", DEALS)
def test_distributed_sampler_gives_every_rank_ddps_indices(n, size, monkeypatch):
    pytest.importorskip("torch")
    for shuffle in (True, False):
        for drop_last in (False, True):
            for seed, epoch in ((0, 0), (0, 3), (5, 1), (2**32 + 3, 2)):
                options = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
                ddp = ddps_shares(n, size, **options)
                assert hvdps_shares(n, size, monkeypatch, **options) == ddp, options
                with monkeypatch.context() as without:  # as if torch were not installed: NumPy draws
                    without.setitem(sys.modules, "torch", None)
                    assert hvdps_shares(n, size, monkeypatch, **options) == ddp, options


@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 1000, 2048, 65537])
def test_without_torch_numpy_draws_torchs_order(n, monkeypatch):
    torch = pytest.importorskip("torch")
    from hvdp.data import ddp_order

    expected = {}
    for seed in (0, 1, 42, 2**31 + 7, 2**32 + 3, 2**40 + 1):
        generator = torch.Generator()
        generator.manual_seed(seed)
        expected[seed] = torch.randperm(n, generator=generator).tolist()
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    for seed, order in expected.items():
        assert ddp_order(n, seed=seed).tolist() == order, seed
    assert ddp_order(n, shuffle=False).tolist() == list(range(n))


def test_without_torch_an_order_torch_draws_otherwise_names_the_fix(monkeypatch):
    from hvdp.data import _ONE_DRAW_BELOW, ddp_order

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install torch==2\.13\.0.*hvdp\.shard"):
        ddp_order(_ONE_DRAW_BELOW, seed=1)


def test_hvdp_shard_keeps_hvdps_own_order():
    ddp = [4, 0, 1, 3, 2]  # torch.randperm(5) seeded 0: DDP's epoch 0 with seed 0
    assert ddp_order(5, seed=0).tolist() == ddp
    assert shard_indices(5, 0, 1, seed=0).tolist() == np.random.default_rng([0, 0]).permutation(5).tolist() != ddp

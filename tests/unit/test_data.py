"""hvdp.data.shard_indices: the rules every rank relies on to take the same number of steps."""

from __future__ import annotations

import numpy as np
import pytest

from hvdp.data import shard_indices


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

"""Data sharding: which examples each rank uses in each epoch."""

from __future__ import annotations

import numbers

import numpy as np


def shard_indices(n_examples: int, rank: int, size: int, *, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, drop_remainder: bool = False) -> np.ndarray:
    """The indices of the examples ``rank`` of ``size`` uses in ``epoch``.

    Every rank draws the same permutation (from ``seed`` and ``epoch``) and takes
    every ``size``-th index from its own offset, so shards together cover the
    data and overlap only in the padding described next. Every rank gets the
    same number of indices, so all ranks take the same number of steps (a rank
    with fewer steps would leave the others waiting in an allreduce): without ``drop_remainder`` the last
    shards are completed with indices from the start of the permutation; with
    it, the ``n_examples % size`` left-over examples are skipped this epoch.

    Example:
        >>> shard_indices(5, 1, 2, shuffle=False).tolist()
        [1, 3, 0]
    """
    if isinstance(n_examples, bool) or not isinstance(n_examples, numbers.Integral) or n_examples < 1:
        raise ValueError(f"n_examples={n_examples!r}; expected an integer >= 1.")
    order = np.random.default_rng([seed, epoch]).permutation(n_examples) if shuffle else np.arange(n_examples)
    if drop_remainder:
        per_rank = n_examples // size
        if per_rank == 0:
            raise ValueError(f"n_examples={n_examples} is fewer than size()={size} with "
                             "drop_remainder=True, so every rank would get no example. "
                             "Use drop_remainder=False or more data.")
    else:
        per_rank = -(-n_examples // size)
    return np.resize(order, per_rank * size)[rank::size]

"""Data sharding: which examples each rank uses in each epoch."""

from __future__ import annotations

import numbers
from typing import List

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


def epoch_order(n_examples: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The order of the examples in ``epoch``: the same permutation :func:`shard_indices` deals from.

    Example:
        >>> epoch_order(4, shuffle=False).tolist()
        [0, 1, 2, 3]
    """
    if isinstance(n_examples, bool) or not isinstance(n_examples, numbers.Integral) or n_examples < 1:
        raise ValueError(f"n_examples={n_examples!r}; expected an integer >= 1.")
    return np.random.default_rng([seed, epoch]).permutation(n_examples) if shuffle else np.arange(n_examples)


def plan_batches(remaining: np.ndarray, batch_size: int, size: int) -> List[np.ndarray]:
    """Cut the examples left in an epoch into global batches of ``batch_size`` per worker.

    Each global batch holds ``batch_size * size`` examples, dealt to the workers in turn
    (worker ``r`` takes ``batch[r::size]``). The last, partial batch is dealt as evenly as
    possible; when it would leave a worker without an example, it joins the batch before
    it instead. Every example left is in exactly one batch: none is repeated or dropped.

    Example:
        >>> [b.tolist() for b in plan_batches(np.arange(7), 2, 2)]
        [[0, 1, 2, 3], [4, 5, 6]]
        >>> [b.tolist() for b in plan_batches(np.arange(5), 2, 2)]
        [[0, 1, 2, 3, 4]]
    """
    step = batch_size * size
    batches = [remaining[start:start + step] for start in range(0, len(remaining), step)]
    if len(batches) > 1 and len(batches[-1]) < size:
        batches[-2:] = [np.concatenate(batches[-2:])]
    return batches

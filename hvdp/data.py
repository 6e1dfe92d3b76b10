"""Data sharding: which examples each rank uses in each epoch, as indices (:func:`shard_indices`), a
``DataLoader`` sampler (:class:`DistributedSampler`) or a sharded ``tf.data`` pipeline (:func:`shard_dataset`)."""

from __future__ import annotations

import importlib
import numbers
import sys
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from hvdp import _runtime
from hvdp import process_sets as _process_sets
from hvdp.collectives import allgather_object


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
    _check_count(n_examples)
    order = np.random.default_rng([seed, epoch]).permutation(n_examples) if shuffle else np.arange(n_examples)
    if drop_remainder and n_examples < size:
        raise ValueError(f"n_examples={n_examples} is fewer than size()={size} with "
                         "drop_remainder=True, so every rank would get no example. "
                         "Use drop_remainder=False or more data.")
    return deal(order, rank, size, drop_remainder)


def deal(order: np.ndarray, rank: int, size: int, drop_last: bool) -> np.ndarray:
    """``rank``'s share of ``order`` when ``size`` ranks take its indices in turn, every share one length.

    Without ``drop_last`` the order is repeated from its start (as many times as it takes) until it fills
    ``size`` equal shares; with it, it is cut to the largest multiple of ``size`` (to nothing when it is
    shorter than ``size``). Then rank ``r`` takes every ``size``-th index from ``r``: the rule of
    ``torch.utils.data.DistributedSampler`` and of :func:`shard_indices`.

    Example:
        >>> deal(np.array([4, 0, 1, 3, 2]), 1, 2, drop_last=False).tolist()
        [0, 3, 4]
    """
    per_rank = len(order) // size if drop_last else -(-len(order) // size)
    return np.resize(order, per_rank * size)[rank::size]


#: Below this many examples torch's CPU randperm draws one 32-bit number a swap (aten's ``randperm_cpu``:
#: ``n < std::numeric_limits<uint32_t>::max() / 20``); :func:`ddp_order` makes those draws with NumPy.
_ONE_DRAW_BELOW = (2**32 - 1) // 20


def ddp_order(n_examples: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The order ``torch.utils.data.DistributedSampler`` deals in ``epoch``.

    Shuffled, ``torch.randperm(n_examples)`` from a ``torch.Generator`` seeded ``seed + epoch``; in
    order, 0, 1, 2, ... When torch is loaded (every torch job), torch draws it. Otherwise NumPy makes the
    same draws torch's CPU ``randperm`` makes (its Mersenne Twister, seeded from the seed's low 32 bits
    as torch's is, and its swaps), so a TensorFlow-only job gets the same order without torch; beyond
    214,748,364 examples, where torch draws differently, torch is imported.

    Example:
        >>> ddp_order(5, seed=0).tolist()
        [4, 0, 1, 3, 2]
    """
    _check_count(n_examples)
    if not shuffle:
        return np.arange(n_examples)
    torch = sys.modules.get("torch")
    if torch is None and n_examples >= _ONE_DRAW_BELOW:
        try:
            torch = importlib.import_module("torch")
        except ImportError as exc:
            raise ImportError(f"hvdp.DistributedSampler: {n_examples} examples are dealt in the order torch's "
                              f"randperm draws for so many, which needs torch, and it is not installed "
                              f"({exc}). Install it (pip install torch==2.13.0), or deal hvdp's own order with "
                              f"hvdp.shard(n, seed=, epoch=).") from exc
    if torch is not None:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(n_examples, generator=generator).numpy()
    return _randperm(n_examples, seed + epoch)


def _randperm(n_examples: int, seed: int) -> np.ndarray:
    """``torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed))`` on the CPU, below
    :data:`_ONE_DRAW_BELOW` examples, without torch: the same MT19937 stream (torch seeds it from the seed's
    low 32 bits, as NumPy's ``RandomState`` does) and the same swaps, ``i`` with ``i + draw % (n - i)``."""
    seeded: Any = np.random.RandomState(seed & 0xFFFFFFFF).get_state(legacy=False)
    bits = np.random.MT19937()
    bits.state = seeded
    offsets = (bits.random_raw(n_examples - 1) % np.arange(n_examples, 1, -1, dtype=np.uint64)).tolist()
    order = list(range(n_examples))
    for i, offset in enumerate(offsets):
        order[i], order[i + offset] = order[i + offset], order[i]
    return np.array(order, dtype=np.int64)


def _check_count(n_examples: int) -> None:
    if isinstance(n_examples, bool) or not isinstance(n_examples, numbers.Integral) or n_examples < 1:
        raise ValueError(f"n_examples={n_examples!r}; expected an integer >= 1.")


def epoch_order(n_examples: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The order of the examples in ``epoch``: the same permutation :func:`shard_indices` deals from.

    Example:
        >>> epoch_order(4, shuffle=False).tolist()
        [0, 1, 2, 3]
    """
    _check_count(n_examples)
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


def shard(
    n_examples: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = False,
    process_set: Optional[_process_sets.ProcessSet] = None,
) -> np.ndarray:
    """The indices of the examples this rank should use in this epoch.

    Shards cover the data, overlap only in padding, and have the same length
    on every rank (see :func:`hvdp.data.shard_indices` for the rules). With
    ``process_set``, the data is split among the set's members only.

    Example:
        >>> for epoch in range(3):                      # doctest: +SKIP
        ...     idx = hvdp.shard(len(x), seed=42, epoch=epoch)
    """
    rank_, size_ = world(process_set, "shard")
    return shard_indices(n_examples, rank_, size_, shuffle=shuffle, seed=seed,
                         epoch=epoch, drop_remainder=drop_remainder)


def world(process_set: Optional[_process_sets.ProcessSet], caller: str) -> Tuple[int, int]:
    """(rank, size) in the job, or in ``process_set``: read at each call, so a resized elastic job gets the new."""
    backend = _runtime.current(caller)
    if process_set is None:
        return backend.rank(), backend.size()
    _process_sets.handle(process_set, caller)
    return process_set.rank(), process_set.size()


def _count(dataset: Any, caller: str) -> int:
    if isinstance(dataset, numbers.Integral) and not isinstance(dataset, bool):
        return int(dataset)
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(f"hvdp.{caller}: {type(dataset).__name__} has no len(), so the examples cannot be dealt. "
                        f"Give a map-style dataset (one with __len__ and __getitem__) or the number of examples; "
                        f"for an iterable dataset, shard inside it by hvdp.rank() and hvdp.size().") from None


class DistributedSampler:
    """The example indices this rank takes each epoch, as a sampler: ``DataLoader(ds, sampler=...)``.

    DDP's ``torch.utils.data.DistributedSampler`` under hvdp, index for index: with the same ``seed``,
    ``shuffle``, ``drop_last`` and epoch, every rank (or process set member) gets exactly the indices
    DDP's sampler gives the rank of that number out of that many replicas. The ranks deal one order
    (:func:`ddp_order`: ``torch.randperm`` seeded ``seed`` + the epoch given to :meth:`set_epoch`, the
    same on every rank), and each takes every ``size``-th index from its own offset (:func:`deal`).
    Every rank gets ``len(sampler)`` indices, so all take the same number of steps: without
    ``drop_last`` the shares are completed with indices from the start of the order (:attr:`repeated`
    of them, at most size - 1); with it, the last
    ``n % size`` examples of the order are left out this epoch (:attr:`left_out`; all of them, and no
    index for any rank, when there are fewer examples than ranks, as with DDP's). :func:`hvdp.shard`
    deals hvdp's own order instead (NumPy's, by the same rule). The ranks and the size are read each
    time an epoch starts, so after an elastic job changes size the next epoch is dealt to the workers
    present (to resume in the middle of an epoch, use :class:`hvdp.elastic.Sampler`, which deals
    hvdp's own order).

    It works for any framework: iterate it for the indices (without torch, NumPy draws torch's order).

    Args:
        dataset: a map-style dataset (anything with ``len()``), or the number of examples.
        shuffle: a new order every epoch; False keeps 0, 1, 2, ... (DDP's order too).
        seed: the seed of the order; the same on every rank.
        drop_last: leave the remainder out instead of repeating examples.
        process_set: deal among a process set's members only.

    Example:
        >>> sampler = hvdp.DistributedSampler(dataset, seed=42)        # doctest: +SKIP
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)  # doctest: +SKIP
        >>> for epoch in range(epochs):                                # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for x, y in loader:
        ...         ...
    """

    def __init__(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 process_set: Optional[_process_sets.ProcessSet] = None) -> None:
        self.n_examples = _count(dataset, "DistributedSampler")
        if self.n_examples < 1:
            raise ValueError(f"hvdp.DistributedSampler: {self.n_examples} examples; the dataset must have at least "
                             f"one.")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"hvdp.DistributedSampler: seed={seed!r}; give a whole number >= 0, the same on "
                             f"every rank.")
        self.shuffle: bool = bool(shuffle)
        self.seed: int = int(seed)
        self.drop_last: bool = bool(drop_last)
        self.process_set: Optional[_process_sets.ProcessSet] = process_set
        self.epoch: int = 0
        world(process_set, "DistributedSampler")  # initialized, and the set usable from this rank

    def set_epoch(self, epoch: int) -> None:
        """Deal ``epoch``'s order from the next iteration on (call it before each epoch, as with DDP's)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"hvdp.DistributedSampler.set_epoch({epoch!r}): give the epoch, a whole number >= 0.")
        self.epoch = int(epoch)

    def _size(self) -> int:
        return world(self.process_set, "DistributedSampler")[1]

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        rank, size = world(self.process_set, "DistributedSampler")
        order = ddp_order(self.n_examples, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        return deal(order, rank, size, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        size = self._size()
        return self.n_examples // size if self.drop_last else -(-self.n_examples // size)

    @property
    def repeated(self) -> int:
        """Examples dealt twice each epoch to make the shards equal (0 with ``drop_last``)."""
        return 0 if self.drop_last else len(self) * self._size() - self.n_examples

    @property
    def left_out(self) -> int:
        """Examples left out each epoch (only with ``drop_last``)."""
        return self.n_examples - len(self) * self._size() if self.drop_last else 0


def shard_dataset(dataset: Any, *, drop_remainder: bool = False,
                  process_set: Optional[_process_sets.ProcessSet] = None) -> Any:
    """This rank's share of a ``tf.data.Dataset``'s examples, the same number on every rank.

    The ranks take turns through the examples as the pipeline produces them: rank ``r`` of ``n`` takes
    the r-th of every n consecutive examples, so the shards together cover the data once (repeated
    pipelines included). A pipeline that is already batched is unbatched, sharded, and batched
    again with its own batch size (per rank, as hvdp's batch sizes are), so ``shard_dataset`` may come
    before or after ``.batch``. To keep the counts equal, the last ``k = total % n`` examples are
    completed with the first ``n - k`` of the pipeline (repeated), or left out with
    ``drop_remainder=True``.

    Every rank must call it (as a collective): the ranks compare the seeds of the pipeline's shuffles
    (one allgather). A shuffle before the sharding must give every rank one order, or their shards
    would overlap: one without a seed is refused, and so is one whose seeds differ between the ranks
    (TensorFlow combines a shuffle's seed with the global seed, which scripts often set by rank).
    Give the shuffle a seed and every rank the same global seed, or shuffle after.

    Example:
        >>> ds = hvdp.shard_dataset(tf.data.Dataset.from_tensor_slices((x, y)))  # doctest: +SKIP
        >>> ds = ds.shuffle(1024).batch(32).repeat()                            # doctest: +SKIP
    """
    import tensorflow as tf

    rank, size = world(process_set, "shard_dataset")
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"hvdp.shard_dataset takes a tf.data.Dataset, got {type(dataset).__name__}. For "
                        f"indices or a DataLoader use hvdp.shard or hvdp.DistributedSampler.")
    batch, seeds = _stages(dataset)
    _check_shuffles(allgather_object(seeds, process_set=process_set))
    examples = dataset.unbatch() if batch is not None else dataset
    if not drop_remainder:  # the tail's group completed with the first n-1 examples (left out when whole)
        examples = examples.concatenate(examples.take(size - 1))

    def pick(*parts: Any) -> Any:
        picked = tf.nest.map_structure(lambda t: t[rank], parts)
        return picked[0] if len(parts) == 1 else picked

    mine = examples.batch(size, drop_remainder=True).map(pick)
    if batch is not None:
        mine = mine.batch(*batch).prefetch(tf.data.AUTOTUNE)
    return mine


def _stages(dataset: Any) -> Tuple[Optional[Tuple[int, bool]], List[Tuple[int, int]]]:
    """The (batch size, drop remainder) of the pipeline's last batching (None if it has none), and the seeds of
    its shuffles as TensorFlow resolved them (the op's seed with the global one); refuses a padded batch."""
    batch = None
    seeds = []
    stage = dataset
    while stage is not None:
        kind = type(stage).__name__
        if kind == "_PaddedBatchDataset":
            raise ValueError("hvdp.shard_dataset: the pipeline has a padded_batch, which cannot be batched again "
                             "after sharding. Call hvdp.shard_dataset before .padded_batch(...).")
        if kind in ("_BatchDataset", "_ParallelBatchDataset") and batch is None:
            batch = (int(stage._batch_size), bool(stage._drop_remainder))
        if kind == "_ShuffleDataset":
            seeds.append((int(stage._seed), int(stage._seed2)))
        stage = getattr(stage, "_input_dataset", None)
    return batch, seeds


def _check_shuffles(gathered: List[Any]) -> None:
    """Every rank shuffles in one order, or all refuse alike (each rank decides from every rank's seeds)."""
    every = [[(int(a), int(b)) for a, b in seeds] for seeds in gathered]
    if any((0, 0) in seeds for seeds in every):
        raise ValueError("hvdp.shard_dataset: the pipeline shuffles without a seed before it is sharded, so "
                         "every rank would shuffle in its own order and their shards would overlap. Give the "
                         "shuffle a seed, the same on every rank (.shuffle(n, seed=42)), or shuffle after "
                         "hvdp.shard_dataset.")
    if any(seeds != every[0] for seeds in every):
        differ = next(r for r, seeds in enumerate(every) if seeds != every[0])
        raise ValueError(f"hvdp.shard_dataset: the pipeline's shuffle seeds are {every[0]} on rank 0 but "
                         f"{every[differ]} on rank {differ}: TensorFlow combines a shuffle's seed with the global "
                         f"seed (tf.random.set_seed, keras.utils.set_random_seed), which differs between the ranks "
                         f"here, so they would shuffle in different orders and their shards would overlap. Set the "
                         f"same global seed on every rank before building the pipeline, or shuffle after "
                         f"hvdp.shard_dataset.")

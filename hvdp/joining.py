"""``hvdp.join``: train on uneven per-rank batch counts, with DDP's ``Join`` meaning.

Inside ``with hvdp.join(model, optimizer):`` each rank runs as many steps as its own
data gives. A rank that runs out waits in Horovod's join, where it contributes zeros
to every allreduce the others still run; their average still divides by the whole
job's size (DDP's default, ``divide_by_initial_world_size=True``). When every rank has
joined, the model and optimizer state of the rank that joined last (the one that
stepped most) are copied to every rank, so the final model is equal everywhere.

While a join is open, what hvdp itself runs every step is made join-safe: the drift
guard compares only the ranks still stepping, and torch's buffers come from the lowest
rank still stepping (both by allreduce: Horovod refuses broadcast and allgather while
a rank has joined). In ``model.fit`` the ranks join at the end of every epoch, before
any callback runs, so callbacks that reduce (``hvdp.keras.MetricAverage``) see ranks
in step again.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import numpy as np

from hvdp import _keras_jobs, _runtime
from hvdp import consistency as _consistency


class Join:
    """The context manager :func:`hvdp.join` returns; ``last_rank`` is set when it closes."""

    def __init__(self, backend: Any, model: Any, optimizer: Any) -> None:
        self.backend, self.model, self.optimizer = backend, model, optimizer
        self.last_rank: Optional[int] = None

    def __enter__(self) -> "Join":
        if self.backend.joining:
            raise RuntimeError("hvdp.join() blocks do not nest; leave the open one first.")
        self.backend.joining = True
        _keras_jobs.epoch_join[0] = self._sync
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        try:
            if kind is None:  # after an exception the job ends through hvdp's failure path, not a join
                self._sync()
        finally:
            self.backend.joining = False
            _keras_jobs.epoch_join[0] = None

    def _sync(self) -> int:
        """Wait for every rank, then give everyone the state of the rank that joined last."""
        backend = self.backend
        last = backend.join()
        backend.broadcast_state(self.model, self.optimizer, last, None)
        guard = getattr(self.optimizer, "_hvdp_guard", None)
        _consistency.adopt_step_counts(guard, backend.broadcast_object(
            _consistency.step_counts(guard), last, None, "hvdp.join.steps"))
        self.last_rank = last
        return last


def join(model: Any, optimizer: Any = None) -> Join:
    """A block in which ranks may run different numbers of steps (uneven data), as DDP's ``Join``.

    Args:
        model: the ``torch.nn.Module`` or Keras 3 model being trained.
        optimizer: its :func:`hvdp.DistributedOptimizer` (its state is synchronized too).

    A rank that leaves the block (or, in ``model.fit``, ends an epoch) early waits,
    contributing zero gradients to the others' steps; averages divide by ``size()``
    (DDP's default). At the end every rank holds the model and optimizer state of the
    rank that stepped most (``block.last_rank``: the rank of the last join; in ``fit`` the
    ranks also join at each epoch's end). Whole job only, not process sets.

    Raises:
        ValueError: ``optimizer`` reduces within a process set.

    Example:
        >>> with hvdp.join(model, opt):  # doctest: +SKIP
        ...     for x, y in my_uneven_batches:
        ...         opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    backend = _runtime.current("join")
    if optimizer is not None and getattr(optimizer, "_hvdp_whole_job", True) is False:
        raise ValueError(
            "hvdp.join() joins the whole job, but this optimizer reduces within a process set. "
            "Fix: give every member of the set the same number of batches (hvdp.shard), or train the "
            "whole job with one hvdp.DistributedOptimizer."
        )
    if getattr(optimizer, "_hvdp_shards", None) is not None:
        raise ValueError(
            "hvdp.join() stands in for a finished rank's allreduces, but this optimizer's state is sharded "
            "(shard_optimizer_state=True): its steps reduce-scatter and all-gather, which a joined rank cannot "
            "take part in. Fix: give every rank the same number of batches (hvdp.DistributedSampler or "
            "hvdp.shard), or shard_optimizer_state=False.")
    return Join(backend, model, optimizer)


def gather_active(backend: Any, obj: Any, ranks: List[int]) -> List[Any]:
    """``allgather_object`` over ``ranks`` that works while ranks have joined: None for a joined rank.

    By two allreduces (Horovod refuses allgather while a rank has joined; a joined rank
    contributes zeros to an allreduce): each rank writes its length, then its pickled
    bytes, into its own row.
    """
    if not backend.joining:
        return backend.allgather_object(obj, None)
    me, size = backend.rank(), backend.size()
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8).astype(np.int32)
    lengths = np.zeros(size, dtype=np.int64)
    lengths[me] = payload.size
    lengths = backend.allreduce(lengths, "sum", "hvdp.join.lengths", None)
    rows = np.zeros((size, int(lengths.max())), dtype=np.int32)
    rows[me, :payload.size] = payload
    rows = backend.allreduce(rows, "sum", "hvdp.join.objects", None)
    found = [None if lengths[r] == 0 else pickle.loads(rows[r, :lengths[r]].astype(np.uint8).tobytes())
             for r in range(size)]
    return [found[r] for r in ranks]

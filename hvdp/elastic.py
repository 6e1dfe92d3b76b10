"""Elastic training: workers may fail, leave and join while the job runs (``hvdp run --elastic``).

Built on Horovod's elastic machinery (``horovod.common.elastic`` and the framework's
``horovod.<framework>.elastic.run``), with the model and optimizer saved, restored
and synced through hvdp's backends, so the same code serves torch modules and
optimizers and Keras 3 models and optimizers on either Keras backend.

How it works: :class:`State` holds the training state; :meth:`State.commit` keeps a
copy of it in memory and checks whether hosts were added or removed. The training
function, decorated with :func:`run`, is started again whenever a collective fails
(a worker died: the state goes back to the last commit) or the hosts change (the
state was just committed); before each start, every worker takes rank 0's state.

Example:
    >>> import hvdp
    >>> hvdp.init()                                                        # doctest: +SKIP
    >>> state = hvdp.elastic.State(model, optimizer, epoch=0, batch=0)     # doctest: +SKIP
    >>> @hvdp.elastic.run
    ... def train(state):
    ...     while state.epoch < epochs:
    ...         while state.batch < batches:
    ...             step(state.batch)
    ...             state.batch += 1
    ...             if state.batch % 10 == 0:
    ...                 state.commit()
    ...         state.epoch, state.batch = state.epoch + 1, 0
    ...         state.commit()
    >>> train(state)                                                       # doctest: +SKIP

To train every example of an epoch exactly once while workers come and go, deal the
examples with a :class:`Sampler` kept in the state (``for idx in state.sampler.batches(state.epoch)``).

Launch it with ``hvdp run --elastic --min-np 1 --max-np 4 --host-discovery-script
./discover_hosts.sh train.py``.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, TypeVar

import numpy as np

from hvdp import _runtime
from hvdp.data import epoch_order, plan_batches

__all__ = ["Sampler", "State", "run"]

F = TypeVar("F", bound=Callable[..., Any])


def _copy(tree: Any) -> Any:
    """A deep copy of a tree of arrays: exported arrays may share memory with live tensors."""
    if isinstance(tree, np.ndarray):
        return np.array(tree, copy=True)
    if isinstance(tree, dict):
        return {key: _copy(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(value) for value in tree)
    return copy.deepcopy(tree)


class State:
    """The training state an elastic job keeps across failures and changes of workers.

    ``model`` and ``optimizer`` are a ``torch.nn.Module`` and ``torch.optim.Optimizer``
    (wrapped or not by :func:`hvdp.DistributedOptimizer`), or a Keras 3 model and
    optimizer. Each keyword of ``extras`` (epoch, batch, a counter...) becomes an
    attribute: read and assign it as ``state.epoch``; it is saved by :meth:`commit`,
    put back by :meth:`restore`, and taken from rank 0 by :meth:`sync` (so are public
    attributes set later). Extras must be picklable. Build a Keras model before
    making its State. A torch optimizer with ``shard_optimizer_state=True`` is saved whole
    (gathered from every worker) at each commit and split again over the workers at each sync.

    Args:
        model: the model being trained, or None.
        optimizer: its optimizer, or None.
        **extras: the other values to keep, with their starting values.

    Raises:
        NotInitializedError: ``hvdp.init()`` was not called first.
        ValueError: an extra's name is one of State's own attributes.

    Example:
        >>> state = hvdp.elastic.State(model, optimizer, epoch=0, batch=0, step=0)  # doctest: +SKIP
        >>> state.register_reset_callbacks([lambda: print("now", hvdp.size(), "workers")])  # doctest: +SKIP
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **extras: Any) -> None:
        from horovod.common.elastic import State as HorovodState

        backend = _runtime.current("elastic.State")
        reserved = sorted(name for name in extras if name.startswith("_") or hasattr(State, name))
        if reserved:
            raise ValueError(f"hvdp.elastic.State: extra(s) {', '.join(map(repr, reserved))} would hide "
                             f"State's own attributes; rename them (e.g. {reserved[0].lstrip('_')}_value).")
        self.model = model
        self.optimizer = optimizer
        self._extras: Dict[str, Any] = {}
        for name, value in extras.items():
            setattr(self, name, value)
        self._saved_model: Optional[Dict[str, np.ndarray]] = None
        self._saved_optimizer: Any = None
        # A sharded optimizer's state is saved whole, gathered from every worker: at a commit or a
        # sync (every worker at once), never here (a worker that joins is alone in making its State).
        self._sharded = getattr(optimizer, "_hvdp_shards", None) is not None
        # Horovod's State tracks the host updates the launcher sends and the reset callbacks.
        self._hosts = HorovodState(bcast_object=lambda obj: backend.broadcast_object(obj, 0, None),
                                   get_rank=backend.rank)
        self.save(whole_job=False)

    # The interface Horovod's elastic run and notification manager call.

    def save(self, whole_job: bool = True) -> None:
        """Keep a copy of the model, optimizer and extras in memory (what :meth:`restore` goes back to).

        ``whole_job``: every worker saves now (a sharded optimizer's state is gathered).
        """
        backend = _runtime.current("elastic.State.save")
        if self.model is not None:
            optimizer = None if self._sharded and not whole_job else self.optimizer
            arrays, optimizer_state = backend.export_state(self.model, optimizer)
            self._saved_model, self._saved_optimizer = _copy(arrays), _copy(optimizer_state)
        self._extras = {name: copy.deepcopy(getattr(self, name)) for name in self._extra_names()}

    def restore(self) -> None:
        """Go back to the last saved state, undoing what was done since (after a worker failed)."""
        backend = _runtime.current("elastic.State.restore")
        if self.model is not None and self._saved_model is not None:
            # A sharded optimizer's parts belong to a world that just broke: its whole saved
            # state is split again over the new one in sync(), which follows every restore.
            optimizer = None if self._sharded else self.optimizer
            backend.import_state(self.model, optimizer, _copy(self._saved_model), _copy(self._saved_optimizer))
        for name, value in self._extras.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Give every worker rank 0's model, optimizer and extras (when workers start or join), and save them."""
        backend = _runtime.current("elastic.State.sync")
        if self.model is not None:
            if self._sharded and self._saved_optimizer is not None:
                # The whole state of the last commit, split over this world's workers; rank 0's
                # then goes to every worker (one that joined has none).
                backend.import_state(self.model, self.optimizer, _copy(self._saved_model),
                                     _copy(self._saved_optimizer))
            backend.broadcast_state(self.model, self.optimizer, 0, None)
        values = backend.broadcast_object({name: getattr(self, name) for name in self._extra_names()}, 0, None)
        for name, value in values.items():
            setattr(self, name, value)
        self.save()

    def commit(self) -> None:
        """Save the state, then check for added or removed hosts (then the training function restarts).

        Every worker must call it at the same points. It copies the whole state, so
        commit every few batches rather than every batch: a failure loses the work
        done since the last commit.

        Raises:
            horovod.common.exceptions.HostsUpdatedInterrupt: hosts changed; :func:`run` handles it.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise Horovod's ``HostsUpdatedInterrupt`` (handled by :func:`run`) if hosts were added or removed."""
        self._hosts.check_host_updates()

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after every reset (workers added or removed), e.g. to rescale the learning rate.

        Example:
            >>> state.register_reset_callbacks([lambda: set_lr(0.1 * hvdp.size())])  # doctest: +SKIP
        """
        self._hosts.register_reset_callbacks(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`run` once Horovod has restarted on the new set of workers (before the sync):
        drops stale host updates and runs the reset callbacks. torch's direct gradient paths learn again
        (the workers that joined start learning; those that survived must meet them on Horovod's path)."""
        direct = sys.modules.get("hvdp.backends.torch.direct.gradients")  # loaded only on torch
        if direct is not None:
            direct.relearn_all()
        self._hosts.on_reset()

    def on_hosts_updated(self, timestamp: int, update_res: Any) -> None:
        """Called by Horovod's notification service when the launcher sees hosts change."""
        self._hosts.on_hosts_updated(timestamp, update_res)

    def _extra_names(self) -> List[str]:
        return [name for name in vars(self) if not name.startswith("_") and name not in ("model", "optimizer")]


def run(func: F) -> F:
    """Decorate the training function of an elastic job; its first argument is a :class:`State`.

    Before ``func`` starts, every worker takes rank 0's state. When a worker fails
    inside a collective, the others go back to the last :meth:`State.commit`,
    Horovod restarts on the workers left, and ``func`` is called again; when hosts
    are added or removed (seen at a commit), the same happens from the state just
    committed. So ``func`` should resume from the state (``while state.epoch < epochs``).
    Outside ``hvdp run --elastic`` it simply runs ``func`` once after the sync.

    Raises:
        TypeError: the first argument is not an :class:`hvdp.elastic.State`.

    Example:
        >>> @hvdp.elastic.run  # doctest: +SKIP
        ... def train(state):
        ...     while state.epoch < 10:
        ...         train_one_epoch(state.model, state.optimizer)
        ...         state.epoch += 1
        ...         state.commit()
        >>> train(hvdp.elastic.State(model, optimizer, epoch=0))  # doctest: +SKIP
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"@hvdp.elastic.run: the first argument of {func.__name__}() must be an "
                            f"hvdp.elastic.State, got {type(state).__name__}. Call it as "
                            f"{func.__name__}(hvdp.elastic.State(model, optimizer, epoch=0), ...).")
        backend = _runtime.current("elastic.run")
        return backend.elastic_run(func)(state, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Sampler:
    """Deals each epoch's examples to the workers so that none is trained twice or skipped as workers change.

    Keep it in the :class:`State` (``State(model, optimizer, sampler=Sampler(...), epoch=0)``):
    it is committed, restored and taken from rank 0 with the model. :meth:`batches` gives
    this worker's indices for each batch left in the epoch. A batch counts as trained from
    the next :meth:`State.commit`; when the workers change, the examples not yet trained are
    dealt again among the workers now present, and a failure goes back, with the model,
    to the examples trained at the last commit.

    Every worker gets ``batch_size`` examples per step (the last step of an epoch: as evenly
    as the examples left allow), so all workers take the same number of steps.

    Args:
        n_examples: the number of examples in the data set.
        batch_size: examples per worker per step.
        shuffle: a new order every epoch (from ``seed`` and the epoch), the same on every worker.
        seed: the seed of the order.

    Raises:
        ValueError: ``n_examples`` or ``batch_size`` is not a whole number of at least 1.

    Example:
        >>> sampler = hvdp.elastic.Sampler(len(x), batch_size=32)                # doctest: +SKIP
        >>> state = hvdp.elastic.State(model, optimizer, sampler=sampler, epoch=0)  # doctest: +SKIP
        >>> @hvdp.elastic.run
        ... def train(state):
        ...     while state.epoch < epochs:
        ...         for number, idx in enumerate(state.sampler.batches(state.epoch), 1):
        ...             step(x[idx], y[idx])
        ...             if number % 10 == 0:
        ...                 state.commit()
        ...         state.epoch += 1
        ...         state.commit()
    """

    def __init__(self, n_examples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        epoch_order(n_examples)  # checks n_examples
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"hvdp.elastic.Sampler: batch_size={batch_size!r}; give the examples per worker "
                             f"per step, a whole number of at least 1 (e.g. batch_size=32).")
        self.n_examples = int(n_examples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch: Optional[int] = None
        #: Examples of this epoch trained while the job had another number of workers.
        self.done = np.empty(0, dtype=np.int64)
        #: Batches trained at ``dealt_to`` workers since ``done`` last grew.
        self.batches_done = 0
        self.dealt_to = 0

    def remaining(self) -> np.ndarray:
        """The examples of the epoch not in :attr:`done`, in the epoch's order."""
        order = epoch_order(self.n_examples, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch or 0)
        return order[~np.isin(order, self.done)] if len(self.done) else order

    def trained(self) -> int:
        """How many examples of the current epoch count as trained (by every worker together)."""
        batches = plan_batches(self.remaining(), self.batch_size, max(self.dealt_to, 1))[:self.batches_done]
        return len(self.done) + sum(len(batch) for batch in batches)

    def _deal(self, size: int) -> None:
        """Make the batches count for ``size`` workers: fold those trained at another size into :attr:`done`."""
        if size != self.dealt_to and self.batches_done:
            trained = plan_batches(self.remaining(), self.batch_size, self.dealt_to)[:self.batches_done]
            self.done = np.sort(np.concatenate([self.done, *trained]))
            self.batches_done = 0
        self.dealt_to = size

    def batches(self, epoch: int) -> Iterator[np.ndarray]:
        """This worker's example indices for each batch of ``epoch`` not trained yet.

        Call it again after every (re)start of the training function: it continues from
        the state's progress, dealing to the workers present now.
        """
        backend = _runtime.current("elastic.Sampler.batches")
        return self._batches(epoch, backend.rank(), backend.size())

    def _batches(self, epoch: int, rank: int, size: int) -> Iterator[np.ndarray]:
        if epoch != self.epoch:
            self.epoch, self.done, self.batches_done, self.dealt_to = epoch, np.empty(0, dtype=np.int64), 0, size
        self._deal(size)
        for batch in plan_batches(self.remaining(), self.batch_size, size)[self.batches_done:]:
            self.batches_done += 1  # trained once the step is done: the next commit keeps it
            yield batch[rank::size]

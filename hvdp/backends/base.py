"""The contract every framework backend implements.

A backend is a small class named ``Backend`` in ``hvdp/backends/<framework>/__init__.py``. It may also offer
framework-specific extras beside the contract, declared in :class:`Extras` and named in its ``extras``
(``sync_batch_norm`` on torch, ``distributed_gradient_tape`` on TensorFlow); the facade says clearly when the
chosen framework has no such extra. The facade in ``hvdp/__init__.py`` validates arguments and dispatches to it;
the backend is the only place that touches the framework and ``horovod.<framework>``.
``tests/unit/test_backends_contract.py`` checks each backend against this Protocol. What both backends do alike
over Horovod is written once, in :class:`HorovodJob`, which each ``Backend`` subclasses.

``process_set`` arguments are the handles the backend returned from ``init`` or
``add_process_set`` (Horovod's process set objects), or None for the whole job;
``root_rank`` is always a rank of the whole job.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from hvdp import _keras_jobs
from hvdp.backends import direct_mpi
from hvdp.errors import FrameworkError, TrainingMismatchError

#: Reductions of gradients (``DistributedOptimizer``, ``DistributedGradientTape``).
REDUCE_OPS = ("average", "sum", "adasum")
#: Reductions ``allreduce`` takes: the gradients' and the elementwise ones, for metrics and votes.
ALLREDUCE_OPS = REDUCE_OPS + ("min", "max", "product")
#: Gradient compressions accepted by ``DistributedOptimizer``.
COMPRESSIONS = ("none", "fp16")


def reduction_plan(op: str, gradient_predivide_factor: float, size: int) -> Tuple[str, float, float]:
    """How to run ``op`` with gradient predivision: (op to run, prescale, postscale).

    Averaging with a predivide factor f sums g/f over ranks, then scales by f/size.

    Example:
        >>> reduction_plan("average", 2.0, 4)
        ('sum', 0.5, 0.5)
    """
    if op == "average" and gradient_predivide_factor != 1.0:
        return "sum", 1.0 / gradient_predivide_factor, gradient_predivide_factor / size
    return op, 1.0, 1.0


def bounds(total: int, members: int, index: int) -> Tuple[int, int]:
    """Elements ``[start, end)`` of a flat buffer of ``total`` that rank ``index`` of ``members`` owns.

    Example:
        >>> [bounds(10, 3, r) for r in range(3)]
        [(0, 4), (4, 7), (7, 10)]
    """
    share, extra = divmod(total, members)
    start = index * share + min(index, extra)
    return start, start + share + (index < extra)


@runtime_checkable
class Backend(Protocol):
    """What hvdp needs from a framework. Arguments arrive already validated."""

    #: The framework name, one of ``hvdp._runtime.FRAMEWORKS``.
    name: str
    #: The :class:`Extras` this framework offers, as methods of the same names.
    extras: Tuple[str, ...]

    def init(self, comm: Any, process_sets: List[List[int]], dynamic: bool) -> List[Any]:
        """Initialize Horovod for this framework; return a handle per process set.

        ``comm``: None (every process), an mpi4py communicator or a list of MPI ranks;
        ``process_sets``: the ranks of each set to register; ``dynamic``: allow
        ``add_process_set`` later.
        """

    def add_process_set(self, ranks: List[int]) -> Any:
        """Register a process set while running; its handle, or None if one with these ranks exists."""

    def remove_process_set(self, handle: Any) -> None:
        """Unregister a process set added while running (every rank calls it)."""

    def shutdown(self, join: bool = True, on_joined: Optional[Callable[[], None]] = None) -> None:
        """Shut Horovod down; with ``join``, first wait until every rank is done with its collectives.

        ``on_joined`` runs once every rank has joined, before the shutdown (a collective may run there).
        """

    #: True inside an ``hvdp.join`` block: what the backend runs each step must be join-safe
    #: (allreduce only; Horovod refuses broadcast and allgather while a rank has joined).
    joining: bool

    def join(self) -> int:
        """Wait, contributing zeros to the others' allreduces, until every rank has joined; the last one's rank."""

    def is_initialized(self) -> bool:
        """True between ``init()`` and ``shutdown()``."""

    def rank(self) -> int:
        """This process's rank among all processes."""

    def size(self) -> int:
        """The number of processes in the job."""

    def local_rank(self) -> int:
        """This process's rank on its host."""

    def local_size(self) -> int:
        """The number of processes on this host."""

    def cross_rank(self) -> int:
        """The index of this host among the hosts."""

    def cross_size(self) -> int:
        """The number of hosts."""

    def controller(self) -> str:
        """The controller the job runs on: ``"gloo"`` or ``"mpi"``."""

    def distributed_optimizer(
        self,
        optimizer: Any,
        model: Any,
        *,
        op: str,
        compression: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
        process_set: Any,
        broadcast_buffers: bool = True,
        sparse_as_dense: bool = False,
        groups: Any = None,
        shard_optimizer_state: bool = False,
    ) -> Any:
        """Wrap ``optimizer`` so each step reduces gradients across the processes of ``process_set``.

        ``groups``: None (one request for all gradients), a number of requests to split them
        into, or (torch) lists of parameters that go together.
        """

    def on_step(self, optimizer: Any, callback: Callable[[Callable[[], List[Tuple[str, Any]]]], None]) -> bool:
        """Call ``callback(parameters)`` after each update of ``optimizer`` (False: this optimizer can't).

        ``parameters()`` lists the optimizer's (name, NumPy array) pairs; the drift guard
        calls it only on the steps it checks.
        """

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int, process_set: Any) -> None:
        """Overwrite parameters (and optimizer state) with those of ``root_rank``."""

    def allreduce(self, value: Any, op: str, name: Optional[str], process_set: Any, out: Any = None) -> Any:
        """Reduce a framework tensor or NumPy array; return the same kind (``out``, when given, holds it)."""

    def allgather(self, value: Any, name: Optional[str], process_set: Any) -> Any:
        """Concatenate every rank's tensor or array along the first dimension."""

    def reducescatter(self, value: Any, op: str, name: Optional[str], process_set: Any) -> Any:
        """Reduce a tensor or array over the ranks and keep this rank's part of the first dimension."""

    def alltoall(self, value: Any, splits: Optional[List[int]], name: Optional[str],
                 process_set: Any) -> Tuple[Any, Optional[List[int]]]:
        """Send ``splits[r]`` rows (equal parts without splits) to each rank r; what came, and with
        ``splits`` the rows from each rank (None without)."""

    def grouped(self, kind: str, values: List[Any], op: str, name: Optional[str], process_set: Any) -> List[Any]:
        """``kind`` ("allreduce", "allgather" or "reducescatter") of every value at once, as one
        Horovod request (one negotiation, fused); each result of its value's kind."""

    def broadcast(self, value: Any, root_rank: int, name: Optional[str], process_set: Any) -> Any:
        """``root_rank``'s tensor or array, on every rank."""

    def broadcast_object(self, obj: Any, root_rank: int, process_set: Any, name: Optional[str] = None) -> Any:
        """``root_rank``'s picklable object, on every rank, whatever the others pass (None, other types)."""

    def allgather_object(self, obj: Any, process_set: Any) -> List[Any]:
        """Every rank's picklable object, in rank order."""

    def barrier(self, process_set: Any) -> None:
        """Return once every rank (of ``process_set``) has called it."""

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        """(name, NumPy array) for each trainable parameter of ``model``."""

    def export_state(self, model: Any, optimizer: Any) -> Tuple[Dict[str, np.ndarray], Any]:
        """All of ``model``'s state as named arrays, and ``optimizer``'s as a tree of arrays (or None)."""

    def import_state(self, model: Any, optimizer: Any, arrays: Dict[str, np.ndarray], optimizer_state: Any) -> None:
        """Load what :meth:`export_state` returned into ``model`` (and ``optimizer``) on this rank."""

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func(state, ...)`` under this framework's ``horovod.<framework>.elastic.run``.

        A failed collective reaches Horovod as ``HorovodInternalError`` (state restored,
        Horovod restarted, ``func`` called again); ``state`` is an ``hvdp.elastic.State``.
        """


class Extras(Protocol):
    """What a framework may offer beyond the contract. A backend names those it has in ``extras``
    and implements them with these parameters; the facade refuses the others, saying what to use."""

    def sync_batch_norm(self, num_features: int, **kwargs: Any) -> Any:
        """torch: a BatchNorm layer whose batch statistics are computed over the job's ranks."""

    def convert_sync_batchnorm(self, module: Any) -> Any:
        """torch: ``module`` with each BatchNorm layer inside it replaced by :meth:`sync_batch_norm`'s."""

    def distributed_gradient_tape(self, tape: Any, op: str, compression: str, process_set: Any) -> Any:
        """TensorFlow: ``tape`` (a ``tf.GradientTape``) with ``gradient()`` reduced across ranks."""


def extra(backend: Backend, name: str, caller: str, owner: str, otherwise: str) -> Callable[..., Any]:
    """The backend's extra ``name`` (one of :class:`Extras`); where its framework has none, a
    FrameworkError saying that ``hvdp.<caller>`` is for ``owner``, then ``otherwise`` (what to use)."""
    if name not in backend.extras:
        raise FrameworkError(f"hvdp.{caller} is for {owner}; the framework is {backend.name!r}{otherwise}")
    return getattr(backend, name)


class HorovodJob:
    """What every backend does the same way on its ``horovod.<framework>`` module, named in ``_hvd``.

    Job calls (init, process sets, rank and size) and the tensor collectives Horovod offers
    alike on every framework. A backend subclasses it, names its module in ``_hvd``, says
    how a value becomes a tensor and back (:meth:`_to_tensor`, :meth:`_from_tensor`), and
    overrides only what its framework does differently.
    """

    _hvd: Any
    name: str
    extras: Tuple[str, ...] = ()
    joining = False

    def init(self, comm: Any, process_sets: List[List[int]], dynamic: bool) -> List[Any]:
        handles = [self._hvd.ProcessSet(ranks) for ranks in process_sets]
        self._hvd.init(comm=comm, process_sets=handles or ("dynamic" if dynamic else None))
        if self._hvd.mpi_enabled() and not self._hvd.gloo_enabled():
            direct_mpi.prepare(comm)  # the direct calls' MPI communicators, while every rank is here
        return handles

    def add_process_set(self, ranks: List[int]) -> Any:
        try:
            return self._hvd.add_process_set(ranks)
        except ValueError as exc:
            if "duplicate" in str(exc):
                return None
            raise

    def remove_process_set(self, handle: Any) -> None:
        self._hvd.remove_process_set(handle)

    def shutdown(self, join: bool = True, on_joined: Optional[Callable[[], None]] = None) -> None:
        # Horovod's shutdown on one rank ends the job's collectives on every rank, so a rank that finishes first
        # (a process set with less work) would break the others' next collective. join() waits, in no collective
        # and never tripping the stall inspector, until every rank has joined. Elastic jobs end by Horovod's driver.
        if join and self._hvd.is_initialized() and self._hvd.size() > 1 \
                and os.environ.get("HOROVOD_ELASTIC") != "1":
            try:
                self.join()
            except TrainingMismatchError:  # this rank left while others still train: said at once, by the caller
                raise
            except Exception:  # the job is ending abnormally (a rank died): shut down regardless
                on_joined = None
        else:
            on_joined = None
        try:
            if on_joined is not None:
                on_joined()
        finally:
            self._hvd.shutdown()

    def join(self) -> int:
        return int(self._hvd.join())

    def on_step(self, optimizer: Any, callback: Callable[[Callable[[], List[Tuple[str, Any]]]], None]) -> bool:
        # A Keras optimizer updates inside a compiled train step: model.fit calls the callback
        # after each batch instead (hvdp/_keras_jobs.py). A backend handles its own optimizers first.
        if not _keras_jobs.is_keras_optimizer(optimizer):
            return False
        _keras_jobs.attach_guard(optimizer, callback, self.named_parameters)
        return True

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        """Each backend lists a model's (name, array) pairs its own way."""
        raise NotImplementedError

    def is_initialized(self) -> bool:
        return bool(self._hvd.is_initialized())

    def rank(self) -> int:
        return int(self._hvd.rank())

    def size(self) -> int:
        return int(self._hvd.size())

    def local_rank(self) -> int:
        return int(self._hvd.local_rank())

    def local_size(self) -> int:
        return int(self._hvd.local_size())

    def cross_rank(self) -> int:
        return int(self._hvd.cross_rank())

    def cross_size(self) -> int:
        return int(self._hvd.cross_size())

    def controller(self) -> str:
        return "mpi" if self._hvd.mpi_enabled() else "gloo"

    # Shared by the collectives; arguments arrive validated by the facade.

    def _set(self, process_set: Any) -> Any:
        """Horovod's process set for hvdp's handle (None: the whole job)."""
        return self._hvd.global_process_set if process_set is None else process_set

    def _op(self, op: str) -> Any:
        """Horovod's reduction for one of :data:`ALLREDUCE_OPS`."""
        return {"average": self._hvd.Average, "sum": self._hvd.Sum, "adasum": self._hvd.Adasum,
                "min": self._hvd.Min, "max": self._hvd.Max, "product": self._hvd.Product}[op]

    def _compression(self, compression: str) -> Any:
        """Horovod's compressor for one of :data:`COMPRESSIONS`."""
        return {"none": self._hvd.Compression.none, "fp16": self._hvd.Compression.fp16}[compression]

    def _to_tensor(self, value: Any, caller: str) -> Tuple[Any, bool]:
        """(framework tensor, came as NumPy) for a tensor or a NumPy array; TypeError naming ``caller``."""
        raise NotImplementedError

    def _from_tensor(self, result: Any, as_numpy: bool) -> Any:
        """``result`` as the kind of value the caller passed (a NumPy array when ``as_numpy``)."""
        raise NotImplementedError

    def allreduce(self, value: Any, op: str, name: Optional[str], process_set: Any, out: Any = None) -> Any:
        tensor, as_numpy = self._to_tensor(value, "allreduce")
        result = self._from_tensor(self._hvd.allreduce(tensor, op=self._op(op), name=name,
                                                       process_set=self._set(process_set)), as_numpy)
        return result if out is None else self._write_out(result, out)

    def _write_out(self, result: Any, out: Any) -> Any:
        """``result`` written into ``out`` (a NumPy array here; backends add their own kinds); ``out``."""
        if not isinstance(out, np.ndarray):
            raise TypeError(f"allreduce on {self.name} writes out= into a NumPy array, got {type(out).__name__}.")
        np.copyto(out, np.asarray(result))
        return out

    def allgather(self, value: Any, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = self._to_tensor(value, "allgather")
        return self._from_tensor(self._hvd.allgather(tensor, name=name, process_set=self._set(process_set)),
                                 as_numpy)

    def broadcast(self, value: Any, root_rank: int, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = self._to_tensor(value, "broadcast")
        return self._from_tensor(self._hvd.broadcast(tensor, root_rank, name=name,
                                                     process_set=self._set(process_set)), as_numpy)

    def reducescatter(self, value: Any, op: str, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = self._to_tensor(value, "reducescatter")
        return self._from_tensor(self._hvd.reducescatter(tensor, op=self._op(op), name=name,
                                                         process_set=self._set(process_set)), as_numpy)

    def alltoall(self, value: Any, splits: Optional[List[int]], name: Optional[str],
                 process_set: Any) -> Tuple[Any, Optional[List[int]]]:
        tensor, as_numpy = self._to_tensor(value, "alltoall")
        horovod_set = self._set(process_set)
        if splits is None:  # equal parts: Horovod returns the received rows alone
            return self._from_tensor(self._hvd.alltoall(tensor, name=name, process_set=horovod_set), as_numpy), None
        sent = self._to_tensor(np.asarray(splits, dtype=np.int32), "alltoall")[0]
        received, counts = self._hvd.alltoall(tensor, splits=sent, name=name, process_set=horovod_set)
        return self._from_tensor(received, as_numpy), [int(c) for c in np.asarray(counts).reshape(-1)]

    def grouped(self, kind: str, values: List[Any], op: str, name: Optional[str], process_set: Any) -> List[Any]:
        pairs = [self._to_tensor(value, f"grouped_{kind}") for value in values]
        horovod_set = self._set(process_set)
        call = getattr(self._hvd, f"grouped_{kind}")
        if kind != "allgather":
            self._check_reduced([tensor for tensor, _ in pairs], op, f"grouped_{kind}")
        # One request per dtype: TensorFlow's grouped ops take tensors of one dtype (torch's any).
        by_dtype: Dict[str, List[int]] = {}
        for i, (tensor, _) in enumerate(pairs):
            by_dtype.setdefault(str(tensor.dtype), []).append(i)
        results: List[Any] = [None] * len(pairs)
        for dtype, indices in by_dtype.items():
            options = {"process_set": horovod_set} if kind == "allgather" else \
                {"process_set": horovod_set, "op": self._op(op)}
            if "name" in inspect.signature(call).parameters:
                options["name"] = f"{name}.{dtype}" if name and len(by_dtype) > 1 else name
            for i, result in zip(indices, call([pairs[i][0] for i in indices], **options)):
                results[i] = self._from_tensor(result, pairs[i][1])
        return results

    def _check_reduced(self, tensors: List[Any], op: str, caller: str) -> None:
        """Refuse what the framework cannot reduce with ``op`` (torch: an elementwise op with gradients)."""

    def broadcast_object(self, obj: Any, root_rank: int, process_set: Any, name: Optional[str] = None) -> Any:
        # Named: Horovod names it after type(obj), which differs between ranks (None off the root) and hangs.
        return self._hvd.broadcast_object(obj, root_rank=root_rank, name=name or "hvdp.broadcast_object",
                                          process_set=self._set(process_set))

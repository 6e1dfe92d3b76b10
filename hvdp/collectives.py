"""hvdp's collectives (``hvdp.allreduce``, ``allgather``, ``broadcast``, ``broadcast_object``,
``allgather_object``, ``barrier``) on any value the facade accepts: framework tensors, NumPy
arrays and Python numbers.

A Python number travels as a one-element array and comes back as a number; a
shape or dtype mismatch between ranks (Horovod's "Mismatched ..." error) becomes a
:class:`~hvdp.errors.TensorMismatchError` naming what every rank passed. Each public
function validates its arguments, then the backend runs the collective; :mod:`hvdp`
exports them.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from hvdp import _runtime
from hvdp import process_sets as _process_sets
from hvdp import validate as _validate
from hvdp.errors import TensorMismatchError, TrainingMismatchError
from hvdp.process_sets import ProcessSet


def describe(value: Any) -> str:
    """A value's dtype and shape as ranks compare them, e.g. ``float32[2, 3]``; a number's type.

    Example:
        >>> describe(np.zeros((2, 3), dtype=np.float32)), describe(7)
        ('float32[2, 3]', 'int')
    """
    if isinstance(value, numbers.Number):
        return type(value).__name__
    if isinstance(value, (list, tuple)):  # a grouped collective's values
        return "[" + ", ".join(describe(item) for item in value) + "]"
    dtype = getattr(value, "dtype", None)
    dtype_name = str(getattr(dtype, "name", None) or dtype).replace("torch.", "")
    return f"{dtype_name}{list(getattr(value, 'shape', ()))}"


def run(kind: str, backend: Any, value: Any, name: Optional[str], call: Callable[[], Any],
        process_set: Any = None) -> Any:
    """Run ``call``; turn Horovod's shape/dtype mismatch into an error naming every rank's tensor."""
    try:
        return call()
    except Exception as exc:
        if "Mismatched" not in str(exc):
            raise
        described = backend.allgather_object(describe(value), _process_sets.handle(process_set, kind))
        ranks = _process_sets.members(process_set, kind)
        per_rank = ", ".join(f"rank {r}: {d}" for r, d in zip(ranks, described))
        if len(set(described)) == 1:  # found by a direct call's check, which compares names and ops too
            raise TensorMismatchError(
                f"hvdp.{kind} of tensor {name or '(unnamed)'}: ranks passed the same dtype and shape ({per_rank}) "
                f"under different names or ops to the same call. Every rank must make the same calls, in the "
                f"same order, with the same names and ops.") from exc
        raise TensorMismatchError(
            f"hvdp.{kind} of tensor {name or '(unnamed)'}: ranks passed different shapes or dtypes "
            f"({per_rank}). Every rank must pass the same dtype and shape"
            f"{' (except the first dimension)' if kind == 'allgather' else ''} to the same collective."
        ) from exc


def number_as_array(value: Any, as_float: bool) -> Any:
    """A Python number as a one-element float64 (``as_float`` or a float) or int64 array."""
    if isinstance(value, complex):
        raise TypeError(f"hvdp collectives do not support complex numbers, got {value!r}.")
    return np.asarray([value], dtype=np.float64 if as_float or isinstance(value, float) else np.int64)


def is_python_number(value: Any) -> bool:
    """True for a Python number (bool, int, float, complex), False for NumPy scalars and arrays."""
    return isinstance(value, numbers.Number) and not isinstance(value, np.generic)


def check_out(value: Any, out: Any) -> None:
    """Refuse an ``out=`` that cannot hold ``value``'s reduction (kind, shape, dtype, memory), naming the fix."""
    if is_python_number(value):
        raise TypeError(f"hvdp.allreduce(out=...) takes a tensor or array value; {value!r} is a Python number, "
                        f"which comes back as a number. Fix: drop out=.")
    if isinstance(out, np.ndarray) != isinstance(value, np.ndarray):
        raise TypeError(f"hvdp.allreduce: out= must be of value's kind, got value {type(value).__name__} and out "
                        f"{type(out).__name__}. Fix: allocate out like value (np.empty_like, torch.empty_like, "
                        f"a tf.Variable), or pass value itself to reduce in place.")
    if describe(out) != describe(value):
        raise ValueError(f"hvdp.allreduce: out= is {describe(out)} but value is {describe(value)}; out must have "
                         f"value's dtype and shape. Fix: allocate it once with empty_like(value).")
    if isinstance(out, np.ndarray) and not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("hvdp.allreduce: out= must be a C-contiguous, writeable NumPy array. "
                         "Fix: allocate it with np.empty_like(value).")
    if hasattr(out, "is_contiguous") and not out.is_contiguous():
        raise ValueError("hvdp.allreduce: out= must be a contiguous tensor. Fix: allocate it with "
                         "torch.empty_like(value), or pass value.contiguous().")


def reduce_value(backend: Any, value: Any, op: str, name: Optional[str], wire: Optional[str], handle: Any,
              process_set: Any, out: Any = None) -> Any:
    """``backend.allreduce`` on ``value``; a number comes back a number (a float for ``"average"``).

    With ``out``, the result is written into it, and it is returned.
    """
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if out is not None:
        check_out(value, out)
    if is_python_number(value):
        as_float = op == "average" or isinstance(value, float)
        array = number_as_array(value, as_float)
        result = run("allreduce", backend, value, name, lambda: backend.allreduce(array, op, wire, handle),
                     process_set)[0]
        return float(result) if as_float else int(result)
    return run("allreduce", backend, value, name, lambda: backend.allreduce(value, op, wire, handle, out),
               process_set)


def gather_value(backend: Any, value: Any, name: Optional[str], wire: Optional[str], handle: Any,
              process_set: Any) -> Any:
    """``backend.allgather`` on ``value``; a number gives the list of every rank's number."""
    if is_python_number(value):
        array = number_as_array(value, False)
        return run("allgather", backend, value, name, lambda: backend.allgather(array, wire, handle),
                   process_set).tolist()
    return run("allgather", backend, value, name, lambda: backend.allgather(value, wire, handle), process_set)


def broadcast_value(backend: Any, value: Any, root: int, name: Optional[str], wire: Optional[str], handle: Any,
              process_set: Any) -> Any:
    """``backend.broadcast`` of ``value`` from the job rank ``root``; a number comes back of its own type."""
    if is_python_number(value):
        array = number_as_array(value, False)
        result = run("broadcast", backend, value, name, lambda: backend.broadcast(array, root, wire, handle),
                     process_set)[0]
        return type(value)(result)
    return run("broadcast", backend, value, name, lambda: backend.broadcast(value, root, wire, handle),
               process_set)


def allreduce(value: Any, op: str = "average", name: Optional[str] = None, *,
              process_set: Optional[ProcessSet] = None, out: Any = None) -> Any:
    """Reduce ``value`` across all processes (or a process set) and return the result to every one.

    Args:
        value: a tensor of the chosen framework, a NumPy array or a Python number;
            the result is of the same kind (a number comes back as a float for
            ``"average"``).
        op: ``"average"``, ``"sum"``, ``"adasum"`` (MPI only), or elementwise ``"min"``, ``"max"``,
            ``"product"`` (a metric's best, an early-stopping vote).
        name: a name for the collective, the same on every rank (optional).
        process_set: reduce only among the members of this :class:`ProcessSet`
            (the same holds for every collective below).
        out: where to write the result, returned instead of a new tensor: a tensor
            (torch), variable (TensorFlow) or array of ``value``'s kind, dtype and
            shape, or ``value`` itself to reduce in place. On torch it saves the
            result's allocation: for large tensors reused call after call (the
            memory of a 64 MB result is faulted in and zeroed anew each call).

    Raises:
        TensorMismatchError: ranks passed different shapes or dtypes.
        TypeError, ValueError: ``out`` cannot hold the result (the message says why).

    Example:
        >>> accuracy = hvdp.allreduce(correct, op="sum") / hvdp.allreduce(total, op="sum")  # doctest: +SKIP
        >>> hvdp.allreduce(t, op="sum", out=t)  # in place: no new tensor  # doctest: +SKIP
    """
    backend = _runtime.current("allreduce")
    handle = _process_sets.handle(process_set, "allreduce")
    _validate.check_op(op, backend, process_set)
    wire = _process_sets.collective_name("allreduce", name, process_set)
    return reduce_value(backend, value, op, name, wire, handle, process_set, out)


def allgather(value: Any, name: Optional[str] = None, *, process_set: Optional[ProcessSet] = None) -> Any:
    """Concatenate every rank's ``value`` along the first dimension, in rank order.

    Ranks may pass different first dimensions; a Python number gives a list
    of every rank's number.

    Example:
        >>> losses = hvdp.allgather(torch.tensor([loss]))  # doctest: +SKIP
    """
    backend = _runtime.current("allgather")
    handle = _process_sets.handle(process_set, "allgather")
    wire = _process_sets.collective_name("allgather", name, process_set)
    return gather_value(backend, value, name, wire, handle, process_set)


def broadcast(value: Any, root_rank: int = 0, name: Optional[str] = None, *,
              process_set: Optional[ProcessSet] = None) -> Any:
    """``root_rank``'s ``value`` on every rank (same kind as given).

    With ``process_set``, ``root_rank`` counts inside the set (0 is its first member).

    Example:
        >>> seed = hvdp.broadcast(np.array([seed]), root_rank=0)  # doctest: +SKIP
    """
    backend = _runtime.current("broadcast")
    handle = _process_sets.handle(process_set, "broadcast")
    root = _validate.check_root(root_rank, "broadcast", process_set)
    wire = _process_sets.collective_name("broadcast", name, process_set)
    return broadcast_value(backend, value, root, name, wire, handle, process_set)


def broadcast_object(obj: Any, root_rank: int = 0, *, process_set: Optional[ProcessSet] = None) -> Any:
    """``root_rank``'s picklable Python object, on every rank (of ``process_set``).

    Example:
        >>> config = hvdp.broadcast_object(config if hvdp.rank() == 0 else None)  # doctest: +SKIP
    """
    backend = _runtime.current("broadcast_object")
    handle = _process_sets.handle(process_set, "broadcast_object")
    _process_sets.count_call(process_set)
    return backend.broadcast_object(obj, _validate.check_root(root_rank, "broadcast_object", process_set), handle)


def allgather_object(obj: Any, *, process_set: Optional[ProcessSet] = None) -> List[Any]:
    """Every rank's picklable Python object, as a list in rank order (of ``process_set``).

    Example:
        >>> hosts = hvdp.allgather_object(socket.gethostname())  # doctest: +SKIP
    """
    backend = _runtime.current("allgather_object")
    handle = _process_sets.handle(process_set, "allgather_object")
    _process_sets.count_call(process_set)
    try:
        return backend.allgather_object(obj, handle)
    except Exception as exc:
        found = left_early(exc, "hvdp.allgather_object")
        if found is exc:
            raise
        raise found from exc


#: What Horovod says when a collective meets a rank that has already joined (at the end of its script).
_JOINED = "not supported with Join"


def left_early(exc: Exception, call: str) -> Exception:
    """``exc``, or where Horovod refused ``call`` because another rank has joined (it finished its script and
    waits for the others at the job's end), a TrainingMismatchError that says so and how to fix it."""
    if _JOINED not in str(exc):
        return exc
    return TrainingMismatchError(
        f"{call} on rank {_runtime.current(call).rank()} met a rank that has finished its script (it waits for the "
        f"others at the job's end): every rank must make the same collective calls, in the same order (a model.fit, "
        f"an evaluate or a metric on some ranks only leaves the others waiting).")


def barrier(*, process_set: Optional[ProcessSet] = None) -> None:
    """Return once every rank (of ``process_set``) has reached this call.

    Example:
        >>> hvdp.barrier()  # doctest: +SKIP
    """
    backend = _runtime.current("barrier")
    handle = _process_sets.handle(process_set, "barrier")
    _process_sets.count_call(process_set)
    backend.barrier(handle)


def broadcast_state(
    model: Any,
    optimizer: Any = None,
    root_rank: int = 0,
    *,
    process_set: Optional[ProcessSet] = None,
) -> None:
    """Make every replica start identical: copy parameters and optimizer state from ``root_rank``.

    Args:
        model: a ``torch.nn.Module`` or a Keras 3 model (built).
        optimizer: its optimizer, whose state (momentum, Adam moments) is copied too.
        root_rank: the rank whose values everyone takes (with ``process_set``: the
            rank inside the set, so 0 is the set's first member).
        process_set: copy only among the members of this :class:`ProcessSet`.

    Example:
        >>> hvdp.broadcast_state(model, optimizer)  # doctest: +SKIP
        >>> hvdp.broadcast_state(model, optimizer, process_set=group)  # doctest: +SKIP
    """
    backend = _runtime.current("broadcast_state")
    handle = _process_sets.handle(process_set, "broadcast_state")
    _process_sets.count_call(process_set)
    backend.broadcast_state(model, optimizer, _validate.check_root(root_rank, "broadcast_state", process_set), handle)


def rows_of(value: Any, kind: str) -> int:
    """The first dimension of ``value``, which ``kind`` splits between the ranks; a TypeError without one."""
    shape = getattr(value, "shape", None)
    if is_python_number(value) or shape is None or len(shape) == 0:
        got = describe(value) if shape is not None or is_python_number(value) else repr(value)
        raise TypeError(f"hvdp.{kind} splits its value's first dimension between the ranks, so it takes a tensor or "
                        f"array with at least one dimension, got {got}. Fix: pass an array of rows, e.g. "
                        f"np.asarray([value]).")
    return int(shape[0])


def reducescatter(value: Any, op: str = "average", name: Optional[str] = None, *,
                  process_set: Optional[ProcessSet] = None) -> Any:
    """Reduce ``value`` over the ranks and give each rank its part of the result's first dimension.

    Rank r of n gets rows ``r * k .. (r + 1) * k`` of the reduction, ``k = rows // n``; when
    the rows do not divide evenly the first ``rows % n`` ranks get one more (as
    ``np.array_split``). ``op`` is ``"average"`` or ``"sum"``. Sharded optimizers reduce
    gradients this way: each rank updates only its part.

    Example:
        >>> part = hvdp.reducescatter(np.arange(6.0).reshape(3, 2) * (hvdp.rank() + 1), op="sum")  # doctest: +SKIP
    """
    backend = _runtime.current("reducescatter")
    handle = _process_sets.handle(process_set, "reducescatter")
    if op in ("adasum", "min", "max", "product"):
        raise ValueError(f"hvdp.reducescatter(op={op!r}): Horovod's reducescatter averages or sums. "
                         "Use op='average' or 'sum' (or hvdp.allreduce for the others).")
    _validate.check_choice("op", op, ("average", "sum"))
    rows_of(value, "reducescatter")
    wire = _process_sets.collective_name("reducescatter", name, process_set)
    return run("reducescatter", backend, value, name, lambda: backend.reducescatter(value, op, wire, handle),
               process_set)


def alltoall(value: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None, *,
             process_set: Optional[ProcessSet] = None) -> Any:
    """Send each rank a slice of ``value``'s first dimension, and receive one from each.

    Without ``splits`` the rows are cut into equal parts, part r to rank r (the rows must
    divide by the number of ranks), and the received parts come back concatenated in rank
    order. With ``splits`` (a count per rank, summing to the rows) rank r gets ``splits[r]``
    rows, and the call returns ``(received, received_splits)``: the rows that came from each
    rank, which differ between ranks (mixture-of-experts routing, sequence-sharded models).

    Example:
        >>> received, counts = hvdp.alltoall(tokens, splits=[3, 1])  # doctest: +SKIP
    """
    backend = _runtime.current("alltoall")
    handle = _process_sets.handle(process_set, "alltoall")
    rows = rows_of(value, "alltoall")
    members = backend.size() if process_set is None else process_set.size()
    if splits is None and rows % members:
        even = [rows // members + (r < rows % members) for r in range(members)]
        raise ValueError(f"hvdp.alltoall: {rows} rows do not divide into {members} equal parts. Fix: pass "
                         f"splits=, the rows for each rank (e.g. splits={even}).")
    if splits is not None:
        splits = _validate.check_splits(splits, rows, members)
    wire = _process_sets.collective_name("alltoall", name, process_set)
    received, counts = run("alltoall", backend, value, name,
                           lambda: backend.alltoall(value, splits, wire, handle), process_set)
    return received if splits is None else (received, counts)

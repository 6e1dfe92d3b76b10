"""hvdp: one API over Horovod for data-parallel training on PyTorch and TensorFlow.

The facade validates arguments and dispatches to the backend of the framework
chosen by :func:`init`. Importing hvdp has no side effects: no framework,
Horovod, file or environment is touched until ``init()``.

Example:
    >>> import hvdp
    >>> hvdp.init()                                   # doctest: +SKIP
    >>> opt = hvdp.DistributedOptimizer(opt, model)   # doctest: +SKIP
    >>> hvdp.broadcast_state(model, opt)              # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any, Callable, List, Optional

import numpy as np

from hvdp import _framework
from hvdp.backends.base import COMPRESSIONS, REDUCE_OPS
from hvdp.data import shard_indices
from hvdp.errors import (
    BuildError,
    FrameworkError,
    HvdpError,
    LaunchError,
    NotInitializedError,
    ReplicaMismatchError,
    TensorMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "BuildError",
    "DistributedOptimizer",
    "FrameworkError",
    "HvdpError",
    "LaunchError",
    "NotInitializedError",
    "DistributedGradientTape",
    "ReplicaMismatchError",
    "SyncBatchNorm",
    "TensorMismatchError",
    "__version__",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_state",
    "check_consistency",
    "cross_rank",
    "cross_size",
    "framework",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shard",
    "shutdown",
    "size",
]


def init(framework: Optional[str] = None) -> None:
    """Choose the framework and initialize Horovod for it.

    Args:
        framework: ``"torch"`` or ``"tensorflow"``. When None, the launcher's
            choice (``hvdp run --framework``, i.e. ``HVDP_FRAMEWORK``) is used,
            else the only framework that is installed.

    Raises:
        FrameworkError: unknown name, not installed, not built into Horovod, or
            contradicting the launcher.

    Example:
        >>> hvdp.init(framework="torch")  # doctest: +SKIP
    """
    _framework.activate(framework)


def framework() -> str:
    """The name of the framework chosen by :func:`init`."""
    return _framework.current("framework").name


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    try:
        _framework.current("is_initialized")
    except NotInitializedError:
        return False
    return True


def shutdown() -> None:
    """Shut Horovod down. :func:`init` may be called again afterwards."""
    _framework.deactivate()


def rank() -> int:
    """This process's rank, ``0 <= rank() < size()``."""
    return _framework.current("rank").rank()


def size() -> int:
    """The number of processes in the job."""
    return _framework.current("size").size()


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _framework.current("local_rank").local_rank()


def local_size() -> int:
    """The number of processes on this host."""
    return _framework.current("local_size").local_size()


def cross_rank() -> int:
    """The index of this process's host among all hosts."""
    return _framework.current("cross_rank").cross_rank()


def cross_size() -> int:
    """The number of hosts in the job."""
    return _framework.current("cross_size").cross_size()


def _check_choice(what: str, value: object, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}. Expected one of: {', '.join(choices)}.")
    return str(value)


def _check_op(op: object, backend: Any) -> str:
    _check_choice("op", op, REDUCE_OPS)
    if op == "adasum" and backend.controller() != "mpi":
        raise ValueError(
            "op='adasum' needs Horovod's MPI controller (Horovod runs Adasum on CPUs over MPI), but this "
            f"job runs on {backend.controller()}. Launch with hvdp run --mpi, or use op='average'."
        )
    return str(op)


def _check_root(root_rank: object, caller: str) -> int:
    world = _framework.current(caller).size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ValueError(f"root_rank={root_rank!r} is not a rank of this job; expected 0..{world - 1}.")
    return root_rank


def DistributedOptimizer(
    optimizer: Any,
    model: Any = None,
    *,
    op: str = "average",
    compression: str = "none",
    backward_passes_per_step: int = 1,
    gradient_predivide_factor: float = 1.0,
) -> Any:
    """Wrap an optimizer so every step uses gradients reduced across all processes.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (torch) or a Keras 3 optimizer.
        model: the torch module being trained (names the gradients), optional.
        op: ``"average"``, ``"sum"`` or ``"adasum"``.
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16).
        backward_passes_per_step: local backward passes per reduction.
        gradient_predivide_factor: with ``op="average"``, divide gradients by
            this factor before summing and by ``size()/factor`` after.

    Returns:
        The optimizer to use: same class name and ``isinstance`` as the input.

    Example:
        >>> opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), model)  # doctest: +SKIP
    """
    backend = _framework.current("DistributedOptimizer")
    _check_op(op, backend)
    _check_choice("compression", compression, COMPRESSIONS)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step!r}; expected an integer >= 1."
        )
    if not isinstance(gradient_predivide_factor, numbers.Real) or gradient_predivide_factor <= 0:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r}; expected a number > 0."
        )
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} only applies to "
            f"op='average' (got op={op!r}); leave it at 1.0."
        )
    return backend.distributed_optimizer(
        optimizer,
        model,
        op=op,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=float(gradient_predivide_factor),
    )


def broadcast_state(model: Any, optimizer: Any = None, root_rank: int = 0) -> None:
    """Make every replica start identical: copy parameters and optimizer state from ``root_rank``.

    Args:
        model: a ``torch.nn.Module`` or a Keras 3 model (built).
        optimizer: its optimizer, whose state (momentum, Adam moments) is copied too.
        root_rank: the rank whose values everyone takes.

    Example:
        >>> hvdp.broadcast_state(model, optimizer)  # doctest: +SKIP
    """
    backend = _framework.current("broadcast_state")
    backend.broadcast_state(model, optimizer, _check_root(root_rank, "broadcast_state"))


def _describe(value: Any) -> str:
    if isinstance(value, numbers.Number):
        return type(value).__name__
    dtype = getattr(value, "dtype", None)
    dtype_name = str(getattr(dtype, "name", None) or dtype).replace("torch.", "")
    return f"{dtype_name}{list(getattr(value, 'shape', ()))}"


def _run_collective(kind: str, value: Any, name: Optional[str], call: Callable[[], Any]) -> Any:
    """Run ``call``; turn Horovod's shape/dtype mismatch into an error naming every rank's tensor."""
    try:
        return call()
    except Exception as exc:
        if "Mismatched" not in str(exc):
            raise
        backend = _framework.current(kind)
        per_rank = ", ".join(f"rank {r}: {d}" for r, d in enumerate(backend.allgather_object(_describe(value))))
        raise TensorMismatchError(
            f"hvdp.{kind} of tensor {name or '(unnamed)'}: ranks passed different shapes or dtypes "
            f"({per_rank}). Every rank must pass the same dtype and shape"
            f"{' (except the first dimension)' if kind == 'allgather' else ''} to the same collective."
        ) from exc


def _number_as_array(value: Any, as_float: bool) -> Any:
    if isinstance(value, complex):
        raise TypeError(f"hvdp collectives do not support complex numbers, got {value!r}.")
    return np.asarray([value], dtype=np.float64 if as_float or isinstance(value, float) else np.int64)


def _is_python_number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, np.generic)


def allreduce(value: Any, op: str = "average", name: Optional[str] = None) -> Any:
    """Reduce ``value`` across all processes and return the result to every one.

    Args:
        value: a tensor of the chosen framework, a NumPy array or a Python number;
            the result is of the same kind (a number comes back as a float for
            ``"average"``).
        op: ``"average"``, ``"sum"`` or ``"adasum"``.
        name: a name for the collective, the same on every rank (optional).

    Raises:
        TensorMismatchError: ranks passed different shapes or dtypes.

    Example:
        >>> accuracy = hvdp.allreduce(correct, op="sum") / hvdp.allreduce(total, op="sum")  # doctest: +SKIP
    """
    backend = _framework.current("allreduce")
    _check_op(op, backend)
    if _is_python_number(value):
        as_float = op == "average" or isinstance(value, float)
        array = _number_as_array(value, as_float)
        result = _run_collective("allreduce", value, name, lambda: backend.allreduce(array, op, name))[0]
        return float(result) if as_float else int(result)
    if isinstance(value, np.generic):
        value = np.asarray(value)
    return _run_collective("allreduce", value, name, lambda: backend.allreduce(value, op, name))


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Concatenate every rank's ``value`` along the first dimension, in rank order.

    Ranks may pass different first dimensions; a Python number gives a list
    of every rank's number.

    Example:
        >>> losses = hvdp.allgather(torch.tensor([loss]))  # doctest: +SKIP
    """
    backend = _framework.current("allgather")
    if _is_python_number(value):
        array = _number_as_array(value, False)
        return _run_collective("allgather", value, name, lambda: backend.allgather(array, name)).tolist()
    return _run_collective("allgather", value, name, lambda: backend.allgather(value, name))


def broadcast(value: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value`` on every rank (same kind as given).

    Example:
        >>> seed = hvdp.broadcast(np.array([seed]), root_rank=0)  # doctest: +SKIP
    """
    backend = _framework.current("broadcast")
    root = _check_root(root_rank, "broadcast")
    if _is_python_number(value):
        array = _number_as_array(value, False)
        result = _run_collective("broadcast", value, name, lambda: backend.broadcast(array, root, name))[0]
        return type(value)(result)
    return _run_collective("broadcast", value, name, lambda: backend.broadcast(value, root, name))


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s picklable Python object, on every rank.

    Example:
        >>> config = hvdp.broadcast_object(config if hvdp.rank() == 0 else None)  # doctest: +SKIP
    """
    backend = _framework.current("broadcast_object")
    return backend.broadcast_object(obj, _check_root(root_rank, "broadcast_object"))


def allgather_object(obj: Any) -> List[Any]:
    """Every rank's picklable Python object, as a list in rank order.

    Example:
        >>> hosts = hvdp.allgather_object(socket.gethostname())  # doctest: +SKIP
    """
    return _framework.current("allgather_object").allgather_object(obj)


def barrier() -> None:
    """Return once every rank has reached this call.

    Example:
        >>> hvdp.barrier()  # doctest: +SKIP
    """
    _framework.current("barrier").barrier()


def check_consistency(model: Any) -> None:
    """Check that every replica holds exactly rank 0's trainable parameters.

    Compares a digest of each parameter across ranks (bit-exact: replicas
    updated by :func:`DistributedOptimizer` from the same start are identical).
    BatchNorm running statistics are buffers, not parameters, and are not compared.

    Raises:
        ReplicaMismatchError: naming each rank that differs and its first differing parameters.

    Example:
        >>> hvdp.check_consistency(model)  # doctest: +SKIP
    """
    backend = _framework.current("check_consistency")
    mine = [(name, list(array.shape), hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16)
             .hexdigest()) for name, array in backend.named_parameters(model)]
    everyone = backend.allgather_object(mine)
    reference = everyone[0]
    problems = []
    for rank_, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        if [(n, s) for n, s, _ in theirs] != [(n, s) for n, s, _ in reference]:
            problems.append(f"rank {rank_} has a different architecture ({len(theirs)} parameters vs "
                            f"{len(reference)} on rank 0)")
            continue
        differing = [n for (n, _, d), (_, _, d0) in zip(theirs, reference) if d != d0]
        problems.append(f"rank {rank_} ({len(differing)} of {len(reference)} parameters differ, e.g. "
                        f"{', '.join(differing[:3])})")
    if problems:
        ranks = [p.split(" ", 2)[1] for p in problems]
        raise ReplicaMismatchError(
            f"Replicas differ from rank 0 on rank(s) {', '.join(ranks)}: {'; '.join(problems)}. "
            "Start every replica with hvdp.broadcast_state(model, optimizer) and step with "
            "hvdp.DistributedOptimizer."
        )


def DistributedGradientTape(tape: Any, *, op: str = "average", compression: str = "none") -> Any:
    """TensorFlow only: a ``tf.GradientTape`` whose ``gradient()`` is reduced across ranks.

    Example:
        >>> with tf.GradientTape() as tape:  # doctest: +SKIP
        ...     loss = loss_fn(y, model(x))
        >>> grads = hvdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    """
    backend = _framework.current("DistributedGradientTape")
    _check_op(op, backend)
    _check_choice("compression", compression, COMPRESSIONS)
    make = getattr(backend, "distributed_gradient_tape", None)
    if make is None:
        raise FrameworkError(
            f"hvdp.DistributedGradientTape is for TensorFlow; the framework is {backend.name!r}. "
            "Use hvdp.DistributedOptimizer instead."
        )
    return make(tape, op, compression)


def SyncBatchNorm(num_features: int, **kwargs: Any) -> Any:
    """torch only: a BatchNorm layer whose batch statistics are computed over all ranks.

    Takes the arguments of ``torch.nn.BatchNorm1d/2d/3d`` (``eps``, ``momentum``,
    ``affine``, ``track_running_stats``); works on CPU and GPU.

    Example:
        >>> bn = hvdp.SyncBatchNorm(64)  # doctest: +SKIP
    """
    backend = _framework.current("SyncBatchNorm")
    make = getattr(backend, "sync_batch_norm", None)
    if make is None:
        raise FrameworkError(
            f"hvdp.SyncBatchNorm is for torch; the framework is {backend.name!r}, whose "
            "BatchNormalization layers keep per-replica statistics."
        )
    return make(num_features, **kwargs)


def shard(
    n_examples: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = False,
) -> np.ndarray:
    """The indices of the examples this rank should use in this epoch.

    Shards cover the data, overlap only in padding, and have the same length
    on every rank (see :func:`hvdp.data.shard_indices` for the rules).

    Example:
        >>> for epoch in range(3):                      # doctest: +SKIP
        ...     idx = hvdp.shard(len(x), seed=42, epoch=epoch)
    """
    backend = _framework.current("shard")
    return shard_indices(n_examples, backend.rank(), backend.size(), shuffle=shuffle, seed=seed,
                         epoch=epoch, drop_remainder=drop_remainder)

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

import numbers
from typing import Any, Optional

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
)

__version__ = "0.1.0"

__all__ = [
    "BuildError",
    "DistributedOptimizer",
    "FrameworkError",
    "HvdpError",
    "LaunchError",
    "NotInitializedError",
    "ReplicaMismatchError",
    "__version__",
    "allreduce",
    "broadcast_state",
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
    _check_choice("op", op, REDUCE_OPS)
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


def allreduce(value: Any, op: str = "average", name: Optional[str] = None) -> Any:
    """Reduce ``value`` across all processes and return the result to every one.

    Args:
        value: a tensor of the chosen framework, a NumPy array or a Python number;
            the result is of the same kind (a number comes back as a float for
            ``"average"``).
        op: ``"average"``, ``"sum"`` or ``"adasum"``.
        name: a name for the collective, the same on every rank (optional).

    Example:
        >>> hvdp.allreduce(correct, op="sum")  # doctest: +SKIP
    """
    backend = _framework.current("allreduce")
    _check_choice("op", op, REDUCE_OPS)
    if isinstance(value, numbers.Number) and not isinstance(value, np.generic):
        if isinstance(value, complex):
            raise TypeError(f"allreduce does not support complex numbers, got {value!r}.")
        as_float = op == "average" or isinstance(value, float)
        array = np.asarray([value], dtype=np.float64 if as_float else np.int64)
        result = backend.allreduce(array, op, name)[0]
        return float(result) if as_float else int(result)
    if isinstance(value, np.generic):
        value = np.asarray(value)
    return backend.allreduce(value, op, name)


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

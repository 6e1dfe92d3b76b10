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

from typing import Any, Optional, Sequence, Union

from hvdp import _keras_fit, _runtime, elastic, keras, profiler
from hvdp import checkpoint as _checkpoint
from hvdp import communicators as _communicators
from hvdp import consistency as _consistency
from hvdp import environment as _environment
from hvdp import joining as _joining
from hvdp import process_sets as _process_sets
from hvdp import validate as _validate
from hvdp.backends.base import COMPRESSIONS
from hvdp.backends.base import extra as _extra
from hvdp.collectives import (
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_state,
    reducescatter,
)
from hvdp.data import DistributedSampler, shard, shard_dataset
from hvdp.errors import (
    BuildError,
    CheckpointError,
    FrameworkError,
    HvdpError,
    LaunchError,
    NotInitializedError,
    ProcessSetError,
    ReplicaMismatchError,
    StallError,
    TensorMismatchError,
    TrainingMismatchError,
)
from hvdp.grouped import grouped_allgather, grouped_allreduce, grouped_reducescatter
from hvdp.joining import join
from hvdp.process_sets import ProcessSet, remove_process_set

__version__ = "0.1.0"

__all__ = [
    "BuildError", "CheckpointError", "DistributedOptimizer", "DistributedSampler", "FrameworkError", "HvdpError",
    "LaunchError", "NotInitializedError", "DistributedGradientTape", "ProcessSet", "ProcessSetError",
    "ReplicaMismatchError", "StallError", "SyncBatchNorm", "TensorMismatchError", "TrainingMismatchError",
    "__version__",
    "add_process_set", "convert_sync_batchnorm", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_object", "broadcast_state", "check_consistency", "load_checkpoint", "save_checkpoint",
    "cross_rank", "cross_size", "elastic", "framework", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_initialized", "join", "keras", "local_rank", "local_size", "my_process_set",
    "rank", "profiler", "reducescatter", "remove_process_set", "shard", "shard_dataset", "shutdown", "size",
]


def init(
    framework: Optional[str] = None,
    comm: Any = None,
    process_sets: Union[Sequence[ProcessSet], str, None] = None,
) -> None:
    """Choose the framework and initialize Horovod for it.

    Args:
        framework: ``"torch"`` or ``"tensorflow"``. When None, the launcher's
            choice (``hvdp run --framework``, i.e. ``HVDP_FRAMEWORK``) is used,
            else the only framework that is installed.
        comm: run hvdp on part of an MPI job (under ``mpirun`` or ``hvdp run --mpi``):
            an mpi4py communicator, or a list of MPI_COMM_WORLD ranks. Only the
            processes in it call ``init``; hvdp's ranks are their ranks in ``comm``.
        process_sets: :class:`ProcessSet` objects to register (the same list on
            every rank), or ``"dynamic"`` to add them later with :func:`add_process_set`.

    Raises:
        FrameworkError: unknown name, not installed, not built into Horovod, or
            contradicting the launcher.
        ProcessSetError: ``comm`` or ``process_sets`` do not fit the job.
        TypeError: ``comm`` is not an mpi4py communicator or a list of ranks.

    Example:
        >>> hvdp.init(framework="torch")  # doctest: +SKIP
        >>> sub = MPI.COMM_WORLD.Split(color=MPI.COMM_WORLD.rank // 2)  # doctest: +SKIP
        >>> hvdp.init(comm=sub)            # doctest: +SKIP
    """
    _environment.check()  # hvdp's variables: a value it does not know is refused here, with the choices
    comm = _communicators.check_comm(comm)
    sets, dynamic = _process_sets.check_process_sets(process_sets, comm)
    _process_sets.start(framework, comm, sets, dynamic)


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set while the job runs; every rank calls it, with the same ranks.

    Needs ``hvdp.init(process_sets="dynamic")``.

    Args:
        process_set: an unregistered :class:`ProcessSet`, or its ranks.

    Returns:
        The registered set, to pass as ``process_set=``.

    Example:
        >>> hvdp.init(process_sets="dynamic")                 # doctest: +SKIP
        >>> evens = hvdp.add_process_set([0, 2])             # doctest: +SKIP
    """
    return _process_sets.add(process_set)


def my_process_set(process_sets: Sequence[ProcessSet]) -> ProcessSet:
    """The set, among sets that do not overlap, that holds this rank.

    Raises:
        ProcessSetError: this rank is in none of the sets, or in several (the sets overlap).

    Example:
        >>> sets = [hvdp.ProcessSet([0, 1]), hvdp.ProcessSet([2, 3])]  # doctest: +SKIP
        >>> hvdp.init(process_sets=sets)                              # doctest: +SKIP
        >>> group = hvdp.my_process_set(sets)                          # doctest: +SKIP
    """
    return _process_sets.mine(process_sets)


def framework() -> str:
    """The name of the framework chosen by :func:`init`."""
    return _runtime.current("framework").name


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    try:
        _runtime.current("is_initialized")
    except NotInitializedError:
        return False
    return True


def shutdown() -> None:
    """Shut Horovod down once every rank has called it; :func:`init` may be called again afterwards.

    Ranks that get here first wait for the others (which may still be training in
    another process set) without taking part in any collective. The same happens at
    interpreter exit, unless this rank dies of an uncaught exception.
    """
    _runtime.deactivate()


def rank() -> int:
    """This process's rank, ``0 <= rank() < size()``."""
    return _runtime.current("rank").rank()


def size() -> int:
    """The number of processes in the job."""
    return _runtime.current("size").size()


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _runtime.current("local_rank").local_rank()


def local_size() -> int:
    """The number of processes on this host."""
    return _runtime.current("local_size").local_size()


def cross_rank() -> int:
    """The index of this process's host among all hosts."""
    return _runtime.current("cross_rank").cross_rank()


def cross_size() -> int:
    """The number of hosts in the job."""
    return _runtime.current("cross_size").cross_size()


def DistributedOptimizer(
    optimizer: Any,
    model: Any = None,
    *,
    op: str = "average",
    compression: str = "none",
    backward_passes_per_step: int = 1,
    gradient_predivide_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
    check_every: Optional[int] = None,
    broadcast_buffers: bool = True,
    sparse_as_dense: bool = False,
    groups: Any = None,
    shard_optimizer_state: bool = False,
) -> Any:
    """Wrap an optimizer so every step uses gradients reduced across all processes (or a process set).

    Args:
        optimizer: a ``torch.optim.Optimizer`` (torch) or a Keras 3 optimizer.
        model: the torch module being trained (names the gradients), optional.
        op: ``"average"``, ``"sum"`` or ``"adasum"``.
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16).
        backward_passes_per_step: local backward passes per reduction.
        gradient_predivide_factor: with ``op="average"``, divide gradients by
            this factor before summing and by ``size()/factor`` after.
        process_set: reduce only within this :class:`ProcessSet` (its members
            train one model; "average" divides by the set's size).
        check_every: the drift guard's interval (torch steps; Keras ``fit`` batches and eager updates): after step 1 and
            every N steps the replicas' parameters are compared, and any difference
            raises :class:`ReplicaMismatchError`. None: ``HVDP_CHECK_EVERY``, else 100;
            0 turns it off.
        broadcast_buffers: torch with ``model``: before each forward in training mode
            every replica takes rank 0's buffers (BatchNorm running statistics), as
            DDP's default does; False keeps them per replica.
        sparse_as_dense: torch: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors by allreduce instead of gathering their rows (Horovod's option). Keras and
            TensorFlow gradients travel dense always.
        groups: gradients in as many requests as this number (None: Horovod's fusion decides on
            torch, one request on Keras), or, on torch, lists of parameters reduced together.
        shard_optimizer_state: ZeRO stage 1: each rank keeps the optimizer state of 1/N of the
            parameters; gradients are reduce-scattered and the updated parameters all-gathered
            (README, "Sharded optimizer state"); torch and Keras 3 optimizers. A torch optimizer's
            ``state_dict()`` then gathers (call it on every rank), as ``hvdp.save_checkpoint`` does.

    With torch, gradients are averaged when ``backward()`` returns (as under DDP), so
    clipping or AMP's ``unscale_`` between ``backward()`` and ``step()`` sees the
    global gradient; ``opt.no_sync()`` keeps the backward passes inside it local.

    Returns:
        The optimizer to use: same class name and ``isinstance`` as the input.

    Example:
        >>> opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), model)  # doctest: +SKIP
    """
    backend = _runtime.current("DistributedOptimizer")
    shard = _validate.check_sharding(shard_optimizer_state, op, groups)
    handle = _process_sets.handle(process_set, "DistributedOptimizer")
    _validate.check_op(op, backend, process_set, caller="hvdp.DistributedOptimizer")
    _validate.check_compression(compression, COMPRESSIONS)
    _validate.check_optimizer_options(op, backward_passes_per_step, gradient_predivide_factor)
    every = _consistency.check_every(check_every)
    wrapped = backend.distributed_optimizer(
        optimizer,
        model,
        op=op,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=float(gradient_predivide_factor),
        process_set=handle,
        broadcast_buffers=bool(broadcast_buffers),
        sparse_as_dense=bool(sparse_as_dense),
        groups=_validate.check_groups(groups),
        shard_optimizer_state=shard,
    )
    ranks = _process_sets.members(process_set, "DistributedOptimizer")
    wrapped._hvdp_whole_job = process_set is None
    wrapped._hvdp_process_set = process_set  # Keras fit's metrics and stop agree over these ranks
    if every and len(ranks) > 1:
        if process_set is None:  # join-safe: a rank waiting in hvdp.join is left out of the comparison
            def gather(obj: Any) -> Any:
                return _joining.gather_active(backend, obj, ranks)
        else:
            def gather(obj: Any) -> Any:
                return backend.allgather_object(obj, handle)
        guard = _consistency.DriftGuard(gather, ranks, every, whole_job=process_set is None)
        wrapped._hvdp_guard = guard
        backend.on_step(wrapped, guard.after_step)
    return wrapped


_runtime.wrap_optimizers_with(DistributedOptimizer)  # for Keras optimizers load_model gives back
_runtime.keras_semantics_from(_keras_fit.install)  # fit and evaluate as under MultiWorkerMirroredStrategy


def save_checkpoint(path: str, model: Any, optimizer: Any = None, **extras: Any) -> None:
    """Save the model, optimizer state and ``extras`` (epoch, step, ...) to ``path``; every rank calls it.

    Rank 0 writes: to a temporary file in the same folder, fsync'ed, then renamed over
    ``path``, so a crash during the save leaves the previous checkpoint intact. The
    other ranks wait until the file is complete, and every rank raises if the save failed.

    Example:
        >>> hvdp.save_checkpoint("ckpt/last.npz", model, optimizer, epoch=epoch, step=step)  # doctest: +SKIP
    """
    _checkpoint.save(_runtime.current("save_checkpoint"), path, model, optimizer, extras)


def load_checkpoint(path: str, model: Any, optimizer: Any = None) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) on every rank; return the saved extras.

    Rank 0 reads and checks the file (format, framework, parameter names and shapes)
    and broadcasts the state, so every replica resumes identical. A missing, corrupt,
    truncated, other-framework or other-architecture checkpoint raises CheckpointError
    naming the file and the problem, on every rank.

    Example:
        >>> extras = hvdp.load_checkpoint("ckpt/last.npz", model, optimizer)  # doctest: +SKIP
        >>> start_epoch = extras["epoch"] + 1  # doctest: +SKIP
    """
    return _checkpoint.load(_runtime.current("load_checkpoint"), path, model, optimizer)


def check_consistency(model: Any, *, process_set: Optional[ProcessSet] = None) -> None:
    """Check that every replica holds exactly rank 0's trainable parameters.

    Compares a digest of each parameter across ranks (bit-exact: replicas
    updated by :func:`DistributedOptimizer` from the same start are identical).
    BatchNorm running statistics are buffers, not parameters, and are not compared.
    With ``process_set``, the set's members are compared with its first member.

    Raises:
        ReplicaMismatchError: naming each rank that differs and its first differing parameters.

    Example:
        >>> hvdp.check_consistency(model)  # doctest: +SKIP
    """
    backend = _runtime.current("check_consistency")
    _consistency.check(backend, model, _process_sets.handle(process_set, "check_consistency"),
                       _process_sets.members(process_set, "check_consistency"))


def DistributedGradientTape(tape: Any, *, op: str = "average", compression: str = "none",
                            process_set: Optional[ProcessSet] = None) -> Any:
    """TensorFlow only: a ``tf.GradientTape`` whose ``gradient()`` is reduced across ranks (of ``process_set``).

    Example:
        >>> with tf.GradientTape() as tape:  # doctest: +SKIP
        ...     loss = loss_fn(y, model(x))
        >>> grads = hvdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)  # doctest: +SKIP
    """
    backend = _runtime.current("DistributedGradientTape")
    handle = _process_sets.handle(process_set, "DistributedGradientTape")
    _validate.check_op(op, backend, process_set, caller="hvdp.DistributedGradientTape")
    _validate.check_compression(compression, COMPRESSIONS)
    make = _extra(backend, "distributed_gradient_tape", "DistributedGradientTape", "TensorFlow",
                  ". Use hvdp.DistributedOptimizer instead.")
    return make(tape, op, compression, handle)


#: Why the batch-norm extras have no TensorFlow form.
_PER_REPLICA = ", whose BatchNormalization layers keep per-replica statistics."


def SyncBatchNorm(num_features: Optional[int] = None, **kwargs: Any) -> Any:
    """A batch norm layer whose batch statistics are computed over all ranks.

    torch: takes the arguments of ``torch.nn.BatchNorm1d/2d/3d`` (``num_features``, ``eps``,
    ``momentum``, ``affine``, ``track_running_stats``); CPU and GPU. TensorFlow: a Keras layer,
    :class:`hvdp.keras.SyncBatchNormalization`, with ``keras.layers.BatchNormalization``'s
    arguments (the features come from its input).

    Example:
        >>> bn = hvdp.SyncBatchNorm(64)  # doctest: +SKIP
    """
    backend = _runtime.current("SyncBatchNorm")
    if backend.name == "tensorflow":
        if num_features is not None:
            raise TypeError(f"hvdp.SyncBatchNorm({num_features!r}) on TensorFlow is a Keras layer, which learns its "
                            f"features from its input: drop num_features (axis=, momentum=, epsilon= as "
                            f"keras.layers.BatchNormalization's).")
        return keras.SyncBatchNormalization(**kwargs)
    make = _extra(backend, "sync_batch_norm", "SyncBatchNorm", "torch", _PER_REPLICA)
    if num_features is None:
        raise TypeError("hvdp.SyncBatchNorm on torch takes num_features, as torch.nn.BatchNorm1d does "
                        "(hvdp.SyncBatchNorm(64)).")
    return make(num_features, **kwargs)


def convert_sync_batchnorm(model: Any) -> Any:
    """torch only: ``model`` with every BatchNorm layer in it a :func:`SyncBatchNorm` (DDP's
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``), keeping its parameters, running
    statistics and mode; returns the model (a BatchNorm layer given alone comes back converted).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))  # doctest: +SKIP
        >>> type(hvdp.convert_sync_batchnorm(model)[1]).__name__  # doctest: +SKIP
        'SyncBatchNorm'
    """
    convert = _extra(_runtime.current("convert_sync_batchnorm"), "convert_sync_batchnorm", "convert_sync_batchnorm",
                     "torch", _PER_REPLICA)
    return convert(model)

"""The Keras 3 adapter, shared by both Keras backends (TensorFlow and torch) as Keras shares ``backend/common``.

Horovod's own Keras layer does not work with Keras 3 (it silently stops
averaging gradients), so hvdp wraps Keras 3 optimizers itself: the optimizer's
``apply`` (which ``apply_gradients`` and ``model.fit`` both go through) reduces
the gradients with the active backend's collectives before the update.
The backends pass in how to reduce and broadcast; nothing here imports a
framework at import time. ``shard_optimizer_state`` for Keras optimizers: :mod:`.sharded`, over
:mod:`.parts` (where this rank's elements lie, the collectives that move them).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hvdp._keras_jobs import is_distributed, is_keras_optimizer
from hvdp.backends.keras import parts, sharded

ReduceFn = Callable[[List[Any]], List[Any]]
BroadcastFn = Callable[[Any, int, str], Any]
_SHARDED = itertools.count()  # sharded optimizers made, in the same order on every rank: their names


def is_keras_model(obj: object) -> bool:
    """True for a Keras 3 layer or model (checked without importing Keras)."""
    keras = sys.modules.get("keras")
    base = getattr(keras, "Layer", None)
    return base is not None and isinstance(obj, base)


def wrap_optimizer(optimizer: Any, reduce_gradients: ReduceFn, backward_passes_per_step: int = 1) -> Any:
    """Make ``optimizer`` reduce gradients across processes before each update.

    The optimizer is changed in place (its class becomes a subclass of its own
    class with the same name), so its state, ``isinstance`` checks and saved
    configs are kept. ``reduce_gradients`` takes the list of gradients of one
    update and returns the reduced list in the same order.

    The reduction sits where Keras turns gradients into an update: after its
    own gradient accumulation (used for ``backward_passes_per_step``, so there
    is one reduction per update) and before gradient clipping (so ``clipnorm``
    clips the global gradient, as a single process would). A variable without
    a gradient on this step gets a zero gradient, so every rank reduces the
    same tensors and none waits for a tensor that never comes.

    Example:
        >>> opt = wrap_optimizer(keras.optimizers.SGD(0.1), reduce_fn)  # doctest: +SKIP
    """
    cls = optimizer.__class__
    if is_distributed(optimizer):
        raise ValueError(
            f"This {cls.__name__} optimizer is already an hvdp.DistributedOptimizer; "
            "wrap the original optimizer once."
        )
    parts.accumulate(optimizer, backward_passes_per_step)

    loss_scaled = _is_loss_scale(optimizer)
    if loss_scaled and backward_passes_per_step > 1:
        raise ValueError("backward_passes_per_step > 1 with a LossScaleOptimizer: give the inner optimizer "
                         "gradient_accumulation_steps instead, or reduce every pass.")

    class _DistributedKerasOptimizer(cls):  # type: ignore[misc, valid-type]
        _hvdp_distributed = True
        _hvdp_reduce = staticmethod(reduce_gradients)

        def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
            variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
            grads = [
                _zeros_like(variable) if grad is None else grad for grad, variable in zip(grads, variables)
            ]
            if loss_scaled:
                # A LossScaleOptimizer checks its gradients for inf/NaN and skips the step on overflow, then
                # hands the unscaled ones to its inner optimizer: reduced first (still scaled), every rank
                # sees the same gradients and takes the same branch, as under tf.distribute.
                grads = self._hvdp_reduce(list(grads))
            result = super().apply(grads, trainable_variables)
            parts.guard_update(self, variables)
            return result

        def _clip_gradients(self, grads: List[Any]) -> List[Any]:
            reduced = self._hvdp_reduce(list(grads))
            if self.gradient_accumulation_steps:
                # Keras averaged the accumulated passes; hvdp's contract sums them.
                reduced = [grad * self.gradient_accumulation_steps for grad in reduced]
            return super()._clip_gradients(reduced)

    _DistributedKerasOptimizer.__name__ = cls.__name__
    _DistributedKerasOptimizer.__qualname__ = cls.__qualname__
    _DistributedKerasOptimizer.__module__ = cls.__module__
    optimizer.__class__ = _DistributedKerasOptimizer
    return optimizer


def shard_optimizer(optimizer: Any, op: str, prescale: float, postscale: float, compression: str,
                    process_set: Any, backward_passes_per_step: int) -> Any:
    """``optimizer`` with its state sharded over Horovod's ``process_set`` (:mod:`hvdp.backends.keras.sharded`)."""
    wire = sharded.Wire(op, compression, prescale, postscale, process_set, f"hvdp.zero.keras.{next(_SHARDED)}")
    return sharded.shard(optimizer, wire, backward_passes_per_step)


def _is_loss_scale(optimizer: Any) -> bool:
    keras = sys.modules.get("keras")
    base = getattr(getattr(keras, "optimizers", None), "LossScaleOptimizer", None)
    return base is not None and isinstance(optimizer, base)


def _zeros_like(variable: Any) -> Any:
    from keras import ops

    return ops.zeros(variable.shape, dtype=variable.dtype)


def broadcast_state(model: Any, optimizer: Any, root_rank: int, broadcast: BroadcastFn) -> None:
    """Assign every variable of ``model`` (and ``optimizer``) the value on ``root_rank``.

    The optimizer is built on the model's trainable variables first if needed,
    so its slots exist on every rank before they are broadcast.
    """
    if is_keras_model(model) and not model.built:
        raise ValueError(
            f"Keras model {model.name!r} is not built yet, so it has no weights to "
            "broadcast. Build it first: call it on a batch, or model.build(input_shape), "
            "or give its first layer an Input shape."
        )
    variables = list(model.variables)
    if optimizer is not None:
        if not is_keras_optimizer(optimizer):
            raise TypeError(
                f"optimizer must be a Keras 3 optimizer for a Keras model, got "
                f"{type(optimizer).__name__}."
            )
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
    is_sharded = isinstance(optimizer, sharded.ShardedKeras)
    if optimizer is not None:  # sharded: its own variables only, each rank's slots being its part of one state
        variables += optimizer._hvdp_own() if is_sharded else list(optimizer.variables)
    for index, variable in enumerate(variables):
        variable.assign(broadcast(variable.value, root_rank, f"hvdp.state.{index}"))
    if is_sharded:
        sharded.broadcast_loaded(optimizer, root_rank, broadcast)


def named_parameters(model: Any, to_numpy: Callable[[Any], Any]) -> List[Tuple[str, Any]]:
    """(path, array) for each trainable variable of a Keras model."""
    return [(variable.path, to_numpy(variable.value)) for variable in model.trainable_variables]


def export_state(model: Any, optimizer: Any, to_numpy: Callable[[Any], Any]) -> Tuple[Dict[str, Any], Any]:
    """A Keras model's variables (keyed by position: layer names differ between processes), and the
    optimizer's variables as a list."""
    arrays = {f"variable {i}": to_numpy(v.value) for i, v in enumerate(model.variables)}
    if optimizer is None:
        return arrays, None
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    if isinstance(optimizer, sharded.ShardedKeras):  # gathered from every rank's part: a collective
        return arrays, optimizer._hvdp_export(to_numpy)
    return arrays, [to_numpy(v.value) for v in optimizer.variables]


def import_state(model: Any, optimizer: Any, arrays: Dict[str, Any], optimizer_state: Any) -> None:
    """Assign what :func:`export_state` returned."""
    for i, variable in enumerate(model.variables):
        variable.assign(arrays[f"variable {i}"])
    if optimizer is None or optimizer_state is None:
        return
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    if isinstance(optimizer, sharded.ShardedKeras):
        if optimizer._hvdp_relayout() and is_keras_model(model):  # the workers changed: fit compiles anew
            model.train_function = None
        optimizer._hvdp_import(optimizer_state)  # this rank's part of the whole state
        return
    if len(optimizer_state) != len(optimizer.variables):
        from hvdp.errors import CheckpointError

        raise CheckpointError(f"the checkpoint holds {len(optimizer_state)} optimizer variables but this "
                              f"{type(optimizer).__name__} has {len(optimizer.variables)}: load it with the "
                              "optimizer class that saved it.")
    for variable, value in zip(optimizer.variables, optimizer_state):
        variable.assign(value)


def in_groups(items: List[Any], groups: Optional[int]) -> List[List[Any]]:
    """``items`` cut into ``groups`` runs in order, as even as they go (all in one without ``groups``).

    Example:
        >>> in_groups([1, 2, 3, 4, 5], 2)
        [[1, 2, 3], [4, 5]]
    """
    count = max(1, min(groups or 1, len(items)))
    cut = [-(-len(items) * i // count) for i in range(count + 1)]
    return [items[cut[i]:cut[i + 1]] for i in range(count)]


def keras_groups(groups: Any) -> Optional[int]:
    """``groups`` for a Keras optimizer, whose gradients come as a list: a number of requests, or None."""
    if isinstance(groups, (list, tuple)):
        raise TypeError("hvdp.DistributedOptimizer(groups=[...]): lists of parameters group a torch optimizer's "
                        "gradients; a Keras optimizer's come as one list, so give the number of requests to split "
                        "it into (groups=2), or leave groups out (one request for all).")
    return groups


def sum_across_ranks(tensor: Any, name: str, process_set: Any = None) -> Any:
    """The sum of a Keras backend tensor over the ranks (of Horovod's ``process_set``), with its gradient
    (the sum of the gradients): Horovod's differentiable allreduce of the Keras backend's framework."""
    import keras

    kwargs = {} if process_set is None else {"process_set": process_set}
    if keras.backend.backend() == "tensorflow":
        import horovod.tensorflow as hvd_tf

        return hvd_tf.allreduce(tensor, op=hvd_tf.Sum, name=name, ignore_name_scope=True, **kwargs)
    import horovod.torch as hvd_torch

    return hvd_torch.allreduce(tensor, op=hvd_torch.Sum, name=name, **kwargs)

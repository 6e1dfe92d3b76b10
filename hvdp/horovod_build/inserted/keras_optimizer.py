# Inserted into horovod/_keras/__init__.py by hvdp's build: DistributedOptimizer and load_model for Keras 3.
#
# Keras 3 optimizers no longer call get_gradients(), _compute_gradients() or
# _aggregate_gradients(), which Horovod's wrapper overrides: wrapped unchanged, they
# train without averaging anything. Every Keras 3 update (apply_gradients, apply,
# model.fit) goes through _backend_apply_gradients() and, with the gradients that
# will be applied, _clip_gradients(): the reduction sits there.


import os as _os
import sys as _sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.mpi_ops import size_op
from horovod.tensorflow.util import as_tf_variable


def is_keras3(keras: Any) -> bool:
    """Whether the module ``keras`` is Keras 3 or later."""
    major = str(getattr(keras, "__version__", "0")).split(".")[0]
    return major.isdigit() and int(major) >= 3


def is_keras3_optimizer(optimizer: Any) -> bool:
    """True for an optimizer of Keras 3 (``keras.optimizers.Optimizer``, updating through ``apply``)."""
    keras = _sys.modules.get("keras")
    return (keras is not None and is_keras3(keras) and isinstance(optimizer, keras.optimizers.Optimizer)
            and hasattr(optimizer, "_clip_gradients"))


class _Keras3State:
    """Per-optimizer bookkeeping, kept out of Keras' attribute tracking (which wraps lists and sets)."""

    def __init__(self) -> None:
        self.local_vars: Set[Any] = set()
        self.vars: Optional[List[Any]] = None


class _CallableVariables(List[Any]):
    """``optimizer.variables`` as Keras 3 returns it (a list), also callable as Horovod's TF2 examples call it."""

    def __call__(self) -> "_CallableVariables":
        return self


_KERAS3_NO_COMPUTE = (
    "Keras 3 optimizers do not compute gradients, so {name}() does not exist on a Keras 3 "
    "hvd.DistributedOptimizer. Compute them with tf.GradientTape (grads = tape.gradient(loss, "
    "model.trainable_variables)) and pass them to optimizer.apply_gradients(zip(grads, "
    "model.trainable_variables)), which averages them across Horovod processes."
)


def create_keras3_distributed_optimizer(optimizer: Any, name: Optional[str], device_dense: str, device_sparse: str,
                                        compression: Any, sparse_as_dense: bool, gradient_predivide_factor: float,
                                        op: Any, backward_passes_per_step: int, average_aggregated_gradients: bool,
                                        groups: Any, process_set: Any, scale_local_gradients: bool) -> Any:
    """Make a Keras 3 ``optimizer`` reduce its gradients across Horovod processes before each update.

    The optimizer is changed in place: its class becomes a subclass of its own
    class, with the same name and module, so its state, ``isinstance`` checks and
    saved models (loadable without Horovod) are kept. ``backward_passes_per_step``
    uses Keras' own gradient accumulation, so one reduction happens per update.
    """
    cls = optimizer.__class__
    if getattr(cls, "_hvd_keras3_distributed", False):
        raise ValueError(f"This {cls.__name__} is already a hvd.DistributedOptimizer: wrap the original "
                         "optimizer once.")
    if cls.__name__ == "LossScaleOptimizer":
        raise TypeError("hvd.DistributedOptimizer cannot wrap a Keras 3 LossScaleOptimizer, which applies its "
                        "updates through its inner optimizer: wrap the inner optimizer instead, "
                        "keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(opt)), or let "
                        "model.compile() add loss scaling under a mixed_float16 policy.")
    steps = int(backward_passes_per_step)
    if steps > 1:
        existing = optimizer.gradient_accumulation_steps
        if existing not in (None, steps):
            raise ValueError(f"backward_passes_per_step={steps} contradicts the optimizer's "
                             f"gradient_accumulation_steps={existing}; set only one of them.")
        if optimizer.built and existing is None:
            raise ValueError("backward_passes_per_step > 1 needs Keras' gradient accumulators, which an optimizer "
                             "that already made a step lacks: wrap the optimizer before its first step.")
        optimizer.gradient_accumulation_steps = steps
    allreduce_grads = hvd._make_allreduce_grads_fn(
        name or f"Distributed{cls.__name__}", device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, groups, process_set)

    class _DistributedKeras3Optimizer(cls):  # type: ignore[misc, valid-type]
        _hvd_keras3_distributed = True

        @property
        def variables(self) -> _CallableVariables:
            return _CallableVariables(super().variables)

        def register_local_var(self, var: Any) -> None:
            """Keep ``var``'s gradient local to each process (not reduced; scaled by 1/size unless
            scale_local_gradients=False)."""
            self._hvd_state.local_vars.add(as_tf_variable(var).ref())

        def _backend_apply_gradients(self, grads: List[Any], trainable_variables: List[Any]) -> Any:
            self._hvd_state.vars = list(trainable_variables)
            try:
                return super()._backend_apply_gradients(grads, trainable_variables)
            finally:
                self._hvd_state.vars = None

        def _clip_gradients(self, grads: List[Any]) -> Any:
            return super()._clip_gradients(self._hvd_reduce(list(grads)))

        def _hvd_reduce(self, grads: List[Any]) -> List[Any]:
            variables = self._hvd_state.vars
            if variables is None or len(variables) != len(grads):
                raise RuntimeError("hvd.DistributedOptimizer: gradients reached Keras 3's update without their "
                                   "variables; apply them with optimizer.apply_gradients() or apply().")
            local = [as_tf_variable(v).ref() in self._hvd_state.local_vars for v in variables]
            shared = [i for i, is_local in enumerate(local) if not is_local]
            reduced = list(grads)
            if shared:
                done = allreduce_grads([grads[i] for i in shared], [as_tf_variable(variables[i]) for i in shared])
                for i, grad in zip(shared, done):
                    reduced[i] = grad
            if scale_local_gradients and any(local):
                horovod_size = tf.cast(size_op(process_set_id=process_set.process_set_id)
                                       if int(_os.environ.get("HOROVOD_ELASTIC", 0)) else process_set.size(),
                                       tf.float32)
                for i, is_local in enumerate(local):
                    if is_local and reduced[i] is not None:
                        reduced[i] = _scale(reduced[i], 1.0 / horovod_size)
            if self.gradient_accumulation_steps and not average_aggregated_gradients:
                # Keras averaged the accumulated passes; Horovod sums them unless told to average.
                reduced = [None if g is None else _scale(g, float(self.gradient_accumulation_steps))
                           for g in reduced]
            return reduced

        def get_gradients(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError(_KERAS3_NO_COMPUTE.format(name="get_gradients"))

        def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError(_KERAS3_NO_COMPUTE.format(name="compute_gradients"))

        def _compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError(_KERAS3_NO_COMPUTE.format(name="_compute_gradients"))

    _DistributedKeras3Optimizer.__name__ = cls.__name__
    _DistributedKeras3Optimizer.__qualname__ = cls.__qualname__
    _DistributedKeras3Optimizer.__module__ = cls.__module__
    optimizer.__class__ = _DistributedKeras3Optimizer
    optimizer._hvd_state = _Keras3State()
    optimizer.process_set = process_set
    return optimizer


def _scale(grad: Any, factor: Any) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def load_keras3_model(keras: Any, wrap_optimizer: Callable[[Callable[..., Any]], Callable[..., Any]], filepath: Any,
                      custom_optimizers: Optional[Sequence[Any]], custom_objects: Optional[Dict[str, Any]],
                      legacy_opts: bool) -> Any:
    """Keras 3's load_model, then the loaded optimizer (its state kept) made a hvd.DistributedOptimizer."""
    if legacy_opts:
        raise ValueError("legacy_opts=True loads keras.optimizers.legacy optimizers, which Keras 3 does not have: "
                         "save and load the model with a keras.optimizers optimizer (legacy_opts=False).")
    objects: Dict[str, Any] = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if is_keras3_optimizer(optimizer) and not getattr(type(optimizer), "_hvd_keras3_distributed", False):
        # wrap_optimizer(factory) returns a function that makes factory's optimizer distributed.
        wrap_optimizer(lambda: optimizer)()
    return model


# Appended to horovod/_keras/callbacks.py by hvdp's build: what Horovod's Keras callbacks need under Keras 3.


import warnings as _warnings
from typing import Any, List, Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow.util import as_tf_variable


class _Keras3Backend:
    """The Keras 2 backend functions Horovod's callbacks call (``keras.backend`` lost them in Keras 3)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @staticmethod
    def get_value(value: Any) -> Any:
        if isinstance(value, (int, float)):
            return value
        return np.asarray(tf.convert_to_tensor(value))

    @staticmethod
    def set_value(variable: Any, value: Any) -> None:
        if not hasattr(variable, "assign"):
            raise TypeError(
                f"Horovod's Keras callback cannot set {variable!r}: under Keras 3 it sets the optimizer's "
                "learning_rate variable, which a LearningRateSchedule replaces. Give the optimizer a float "
                "learning_rate, or drop the callback and let the schedule set the learning rate."
            )
        variable.assign(value)

    @staticmethod
    def constant(value: Any, name: Optional[str] = None) -> Any:
        return tf.constant(value)


def keras2_backend(backend: Any) -> Any:
    """``backend`` itself where it still has Keras 2's functions, else a Keras 3 stand-in."""
    return backend if hasattr(backend, "get_value") else _Keras3Backend(backend)


def learning_rate_of(optimizer: Any) -> Any:
    """The learning rate Horovod's callbacks read and set: ``lr`` before Keras 3, ``learning_rate`` since."""
    return optimizer.lr if hasattr(optimizer, "lr") else optimizer.learning_rate


def momentum_is_variable(optimizer: Any) -> bool:
    """Whether momentum correction can change ``optimizer``'s momentum during training.

    Keras 3 optimizers keep momentum as a Python float, compiled into the
    training step as a constant: changing it later has no effect, so the
    correction is skipped, with a warning.
    """
    if not hasattr(optimizer, "momentum"):
        return False
    momentum = optimizer.momentum
    if isinstance(momentum, (int, float)):
        if momentum:
            _warnings.warn(
                "Horovod's learning rate callbacks do not apply momentum correction to Keras 3 optimizers "
                "(their momentum is a constant of the compiled training step); pass momentum_correction=False "
                "to silence this warning.", stacklevel=3)
        return False
    return True


def optimizer_variables(optimizer: Any) -> List[Any]:
    """An optimizer's variables: a method before TensorFlow 2.11, a list (Keras 3) or callable list since."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def keras3_prebuild(model: Any) -> bool:
    """Build a Keras 3 model's optimizer before training (Keras 2 built it at the first step).

    True when the model and its optimizer hold every variable now, so that a
    broadcast before the first step makes that step identical on every process.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "_clip_gradients") or not getattr(model, "built", False):
        return False
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return True


def is_variable(var: Any) -> bool:
    """A ``tf.Variable``, or a Keras 3 variable (which holds one)."""
    return isinstance(as_tf_variable(var), tf.Variable)


def variable_ref(var: Any) -> Any:
    """A hashable reference to ``var`` (Keras 3 variables have no ``ref()``)."""
    return as_tf_variable(var).ref()

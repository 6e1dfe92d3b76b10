# Inserted at the end of horovod/tensorflow/util.py by hvdp's build.


import sys as _sys
from typing import Any

import tensorflow as tf


def as_tf_variable(var: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; any other object unchanged.

    Keras 3 variables are not ``tf.Variable``s: they have no ``ref()`` and no
    ``device``, and a ``tf.function`` receives them as tensors it cannot assign.
    Horovod therefore works on the ``tf.Variable`` that holds their value (the
    one Keras reads and updates, and that a ``GradientTape`` watches).
    """
    if isinstance(var, tf.Variable):
        return var
    keras: Any = _sys.modules.get("keras")
    keras_variable = getattr(keras, "Variable", None)
    if keras_variable is None or not isinstance(var, keras_variable):
        return var
    value = getattr(var, "_value", None)
    if isinstance(value, tf.Variable):
        return value
    if keras.backend.backend() == "tensorflow":
        raise ValueError(f"The Keras variable {var.path!r} is not built yet: build the model "
                         "(call it on a batch, or model.build(input_shape)) before using it with Horovod.")
    raise TypeError(
        f"Horovod's TensorFlow API got the Keras variable {var.path!r} of the "
        f"{keras.backend.backend()!r} Keras backend, which has no tf.Variable behind it. "
        "Set KERAS_BACKEND=tensorflow, or use horovod.torch with the torch backend."
    )

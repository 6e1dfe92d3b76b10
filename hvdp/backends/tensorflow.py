"""The TensorFlow backend, over ``horovod.tensorflow``'s collective ops.

Horovod's Keras layer (``horovod.tensorflow.keras``) is not used: with Keras 3
it runs but does not average gradients. Keras 3 optimizers are wrapped by
:mod:`hvdp.keras`, with the reduction done by Horovod's TensorFlow ops, which
work both eagerly and inside ``tf.function`` (``model.fit``).
"""

from __future__ import annotations

from typing import Any, List, Optional

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdp import keras as hvdp_keras
from hvdp.backends.base import reduction_plan

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def _refuse_xla() -> None:
    """Horovod's ops have no XLA kernels unless built with them: fail clearly."""
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise RuntimeError(
            "hvdp.DistributedOptimizer cannot reduce gradients inside an XLA-compiled "
            "function: Horovod's TensorFlow ops have no XLA kernels in this build. "
            "Compile the model with model.compile(..., jit_compile=False), or use "
            "tf.function(jit_compile=False) in a custom loop."
        )


class Backend:
    """hvdp's contract (:class:`hvdp.backends.base.Backend`) on TensorFlow/Keras 3."""

    name = "tensorflow"

    def init(self) -> None:
        hvd.init()

    def shutdown(self) -> None:
        hvd.shutdown()

    def is_initialized(self) -> bool:
        return bool(hvd.is_initialized())

    def rank(self) -> int:
        return int(hvd.rank())

    def size(self) -> int:
        return int(hvd.size())

    def local_rank(self) -> int:
        return int(hvd.local_rank())

    def local_size(self) -> int:
        return int(hvd.local_size())

    def cross_rank(self) -> int:
        return int(hvd.cross_rank())

    def cross_size(self) -> int:
        return int(hvd.cross_size())

    def distributed_optimizer(
        self,
        optimizer: Any,
        model: Any,
        *,
        op: str,
        compression: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
    ) -> Any:
        if not hvdp_keras.is_keras_optimizer(optimizer):
            raise TypeError(
                f"hvdp.DistributedOptimizer on tensorflow takes a Keras 3 optimizer "
                f"(keras.optimizers.Optimizer), got {type(optimizer).__module__}."
                f"{type(optimizer).__name__}."
            )
        if backward_passes_per_step != 1:
            raise ValueError(
                f"backward_passes_per_step={backward_passes_per_step} is not supported "
                "for Keras optimizers yet; use backward_passes_per_step=1."
            )
        name, prescale, postscale = reduction_plan(op, gradient_predivide_factor, self.size())
        horovod_op, comp = _OPS[name], _COMPRESSIONS[compression]

        def reduce(tensors: List[Any]) -> List[Any]:
            _refuse_xla()
            tensors = [tf.convert_to_tensor(t) for t in tensors]
            if name == "adasum":
                return [hvd.allreduce(t, op=horovod_op, compression=comp) for t in tensors]
            return list(hvd.grouped_allreduce(
                tensors, op=horovod_op, compression=comp,
                prescale_factor=prescale, postscale_factor=postscale,
            ))

        return hvdp_keras.wrap_optimizer(optimizer, reduce)

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int) -> None:
        if hvdp_keras.is_keras_model(model):
            hvdp_keras.broadcast_state(
                model, optimizer, root_rank,
                lambda value, root, name: hvd.broadcast(tf.convert_to_tensor(value), root, name=name),
            )
            return
        if isinstance(model, (list, tuple)) and all(isinstance(v, tf.Variable) for v in model):
            for index, variable in enumerate(model):
                variable.assign(hvd.broadcast(variable, root_rank, name=f"hvdp.state.{index}"))
            return
        raise TypeError(
            f"broadcast_state on tensorflow takes a Keras 3 model or a list of tf.Variable, "
            f"got {type(model).__name__}."
        )

    def allreduce(self, value: Any, op: str, name: Optional[str]) -> Any:
        if isinstance(value, np.ndarray):
            return hvd.allreduce(tf.constant(value), op=_OPS[op], name=name).numpy()
        if isinstance(value, (tf.Tensor, tf.Variable)):
            return hvd.allreduce(value, op=_OPS[op], name=name)
        raise TypeError(
            f"allreduce on tensorflow takes a tf.Tensor, a NumPy array or a Python number, "
            f"got {type(value).__name__}."
        )

"""The PyTorch backend, over ``horovod.torch``.

Native torch optimizers are wrapped by Horovod's own DistributedOptimizer (it
works on current PyTorch once Horovod is built as C++17); Keras 3 optimizers on
the torch Keras backend are wrapped by :mod:`hvdp.keras` with torch collectives.
"""

from __future__ import annotations

from typing import Any, List, Optional

import horovod.torch as hvd
import numpy as np
import torch

from hvdp import keras as hvdp_keras
from hvdp.backends.base import reduction_plan

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


class Backend:
    """hvdp's contract (:class:`hvdp.backends.base.Backend`) on PyTorch."""

    name = "torch"

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
        if isinstance(optimizer, torch.optim.Optimizer):
            named: Optional[list] = None
            if model is not None:
                if not isinstance(model, torch.nn.Module):
                    raise TypeError(
                        f"model must be the torch.nn.Module being trained (used to name "
                        f"gradients), got {type(model).__name__}. Pass model=None to "
                        f"let Horovod name them by position."
                    )
                named = list(model.named_parameters())
            return hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named,
                compression=_COMPRESSIONS[compression],
                backward_passes_per_step=backward_passes_per_step,
                op=_OPS[op],
                gradient_predivide_factor=gradient_predivide_factor,
            )
        if hvdp_keras.is_keras_optimizer(optimizer):
            if backward_passes_per_step != 1:
                raise ValueError(
                    f"backward_passes_per_step={backward_passes_per_step} is not supported "
                    "for Keras optimizers yet; use backward_passes_per_step=1."
                )
            name, prescale, postscale = reduction_plan(op, gradient_predivide_factor, self.size())
            horovod_op, comp = _OPS[name], _COMPRESSIONS[compression]

            def reduce(tensors: List[Any]) -> List[Any]:
                if name == "adasum":
                    return [hvd.allreduce(t, op=horovod_op, compression=comp) for t in tensors]
                return list(hvd.grouped_allreduce(
                    tensors, op=horovod_op, compression=comp,
                    prescale_factor=prescale, postscale_factor=postscale,
                ))

            return hvdp_keras.wrap_optimizer(optimizer, reduce)
        raise TypeError(
            f"hvdp.DistributedOptimizer on torch takes a torch.optim.Optimizer or a Keras 3 "
            f"optimizer (KERAS_BACKEND=torch), got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int) -> None:
        if hvdp_keras.is_keras_model(model):
            hvdp_keras.broadcast_state(
                model, optimizer, root_rank,
                lambda value, root, name: hvd.broadcast(value.detach(), root, name=name),
            )
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"broadcast_state on torch takes a torch.nn.Module or a Keras 3 model, "
                f"got {type(model).__name__}."
            )
        hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer for a torch module, got "
                    f"{type(optimizer).__name__}."
                )
            hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)

    def allreduce(self, value: Any, op: str, name: Optional[str]) -> Any:
        if isinstance(value, np.ndarray):
            result = hvd.allreduce(torch.from_numpy(np.ascontiguousarray(value)), op=_OPS[op], name=name)
            return result.numpy()
        if isinstance(value, torch.Tensor):
            return hvd.allreduce(value, op=_OPS[op], name=name)
        raise TypeError(
            f"allreduce on torch takes a torch.Tensor, a NumPy array or a Python number, "
            f"got {type(value).__name__}."
        )

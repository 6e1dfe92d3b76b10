"""The PyTorch backend, over ``horovod.torch``.

Native torch optimizers are wrapped by Horovod's own DistributedOptimizer (it
works on current PyTorch once Horovod is built as C++17); Keras 3 optimizers on
the torch Keras backend are wrapped by :mod:`hvdp.keras` with torch collectives.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional, Tuple

import horovod.torch as hvd
import numpy as np
import torch

from hvdp import keras as hvdp_keras
from hvdp.backends.base import reduction_plan

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def _as_tensor(value: Any, caller: str) -> Tuple[torch.Tensor, bool]:
    """(tensor, came_as_numpy) for a torch tensor or a NumPy array."""
    if isinstance(value, torch.Tensor):
        return value, False
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)), True
    raise TypeError(
        f"{caller} on torch takes a torch.Tensor, a NumPy array or a Python number, got {type(value).__name__}."
    )


def _same_kind(result: torch.Tensor, as_numpy: bool) -> Any:
    return result.detach().numpy() if as_numpy else result


class SyncBatchNorm(hvd.SyncBatchNorm):
    """Batch norm whose batch statistics are computed over all ranks.

    On GPUs it is Horovod's SyncBatchNorm; on CPUs (where Horovod's refuses to
    run) the per-channel sum, sum of squares and count are summed across ranks
    with Horovod's differentiable allreduce, so forward and backward equal one
    BatchNorm over the union of the ranks' batches.
    """

    _instances = itertools.count()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Layers are built in the same order on every rank, so this name matches across ranks.
        self._hvdp_name = f"hvdp.sync_batch_norm.{next(self._instances)}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda or not self.training or hvd.size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        count = input.new_full((1,), float(input.numel() // channels))
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = hvd.allreduce(local, op=hvd.Sum, name=self._hvdp_name)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


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

    def controller(self) -> str:
        return "mpi" if hvd.mpi_enabled() else "gloo"

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
            name, prescale, postscale = reduction_plan(op, gradient_predivide_factor, self.size())
            horovod_op, comp = _OPS[name], _COMPRESSIONS[compression]

            def reduce(tensors: List[Any]) -> List[Any]:
                if name == "adasum":
                    return [hvd.allreduce(t, op=horovod_op, compression=comp) for t in tensors]
                return list(hvd.grouped_allreduce(
                    tensors, op=horovod_op, compression=comp,
                    prescale_factor=prescale, postscale_factor=postscale,
                ))

            return hvdp_keras.wrap_optimizer(optimizer, reduce, backward_passes_per_step)
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
        tensor, as_numpy = _as_tensor(value, "allreduce")
        return _same_kind(hvd.allreduce(tensor, op=_OPS[op], name=name), as_numpy)

    def allgather(self, value: Any, name: Optional[str]) -> Any:
        tensor, as_numpy = _as_tensor(value, "allgather")
        return _same_kind(hvd.allgather(tensor, name=name), as_numpy)

    def broadcast(self, value: Any, root_rank: int, name: Optional[str]) -> Any:
        tensor, as_numpy = _as_tensor(value, "broadcast")
        return _same_kind(hvd.broadcast(tensor, root_rank, name=name), as_numpy)

    def broadcast_object(self, obj: Any, root_rank: int) -> Any:
        return hvd.broadcast_object(obj, root_rank=root_rank)

    def allgather_object(self, obj: Any) -> List[Any]:
        return list(hvd.allgather_object(obj))

    def barrier(self) -> None:
        hvd.barrier()

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        if hvdp_keras.is_keras_model(model):
            return hvdp_keras.named_parameters(model, lambda value: value.detach().cpu().numpy())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a torch.nn.Module or a Keras 3 model, got {type(model).__name__}.")
        return [(name, tensor.detach().cpu().numpy()) for name, tensor in model.named_parameters()]

    # Framework-specific extras (beside the neutral names).

    def sync_batch_norm(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return SyncBatchNorm(*args, **kwargs)

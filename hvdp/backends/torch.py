"""The PyTorch backend, over ``horovod.torch``.

Native torch optimizers are wrapped by Horovod's own DistributedOptimizer (it
works on current PyTorch once Horovod is built as C++17); Keras 3 optimizers on
the torch Keras backend are wrapped by :mod:`hvdp.keras` with torch collectives.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle
import horovod.torch as hvd
import numpy as np
import torch

from hvdp import keras as hvdp_keras
from hvdp import profiler
from hvdp.backends._horovod import HorovodJob
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


def _map_tensors(tree: Any, to_numpy: bool) -> Any:
    """``tree`` with torch tensors turned into NumPy arrays, or back."""
    if isinstance(tree, dict):
        return {key: _map_tensors(value, to_numpy) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(value, to_numpy) for value in tree)
    if to_numpy and isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if not to_numpy and isinstance(tree, np.ndarray):
        return torch.from_numpy(np.array(tree))
    return tree


def _same_kind(result: torch.Tensor, as_numpy: bool) -> Any:
    return result.detach().numpy() if as_numpy else result


def _set(process_set: Any) -> Any:
    """Horovod's process set for hvdp's handle (None: the whole job)."""
    return hvd.global_process_set if process_set is None else process_set


#: Longest sleep between two polls of an unfinished collective (seconds).
_POLL_MAX_SLEEP = 0.0005


def _wait(handle: Any) -> None:
    """Block until the collective of ``handle`` is done, sleeping between polls.

    Horovod's own wait (``horovod_torch_wait_and_clear``) spins on ``sched_yield``,
    which keeps a core busy for the whole allreduce; with one compute thread per
    rank on a small CPU machine that core is the one Horovod's background thread
    and Gloo need. Polling with short sleeps (50 us, doubling up to 0.5 ms) frees it.
    """
    pause = 0.00005
    try:
        while not hvd.poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_SLEEP)
    except Exception:  # an unknown or failed handle: synchronize() reports it, as Horovod does
        return


def _sleeping_synchronize(optimizer: Any) -> Any:
    """``optimizer.synchronize`` that first waits for its pending gradient allreduces with :func:`_wait`."""
    synchronize = optimizer.synchronize

    def wait_then_synchronize() -> Any:
        for handle, _ in list(optimizer._handles.values()):
            if handle is not None and not callable(handle):
                _wait(handle)
        return synchronize()

    return wait_then_synchronize


def _cpu(value: Any) -> Any:
    """``value`` with every tensor inside moved to the CPU (to pickle optimizer state)."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(item) for item in value)
    return value


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


class Backend(HorovodJob):
    """hvdp's contract (:class:`hvdp.backends.base.Backend`) on PyTorch."""

    _hvd = hvd
    name = "torch"

    def distributed_optimizer(
        self,
        optimizer: Any,
        model: Any,
        *,
        op: str,
        compression: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
        process_set: Any,
    ) -> Any:
        horovod_set = _set(process_set)
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
            wrapped = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named,
                compression=_COMPRESSIONS[compression],
                backward_passes_per_step=backward_passes_per_step,
                op=_OPS[op],
                gradient_predivide_factor=gradient_predivide_factor,
                process_set=horovod_set,
            )
            # step() waits for the gradient allreduces in synchronize(): that wait is phase "sync".
            wrapped.synchronize = profiler.timed(_sleeping_synchronize(wrapped))
            return wrapped
        if hvdp_keras.is_keras_optimizer(optimizer):
            size = self.size() if process_set is None else int(process_set.size())
            name, prescale, postscale = reduction_plan(op, gradient_predivide_factor, size)
            horovod_op, comp = _OPS[name], _COMPRESSIONS[compression]

            # Named: Horovod's torch names for unnamed tensors count per process, not per set.
            def reduce(tensors: List[Any]) -> List[Any]:
                if name == "adasum":
                    return [hvd.allreduce(t, op=horovod_op, compression=comp, name=f"hvdp.gradients.{i}")
                            for i, t in enumerate(tensors)]
                return list(hvd.grouped_allreduce(
                    tensors, op=horovod_op, compression=comp, name="hvdp.gradients",
                    prescale_factor=prescale, postscale_factor=postscale, process_set=horovod_set,
                ))

            return hvdp_keras.wrap_optimizer(optimizer, profiler.timed(reduce), backward_passes_per_step)
        raise TypeError(
            f"hvdp.DistributedOptimizer on torch takes a torch.optim.Optimizer or a Keras 3 "
            f"optimizer (KERAS_BACKEND=torch), got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int, process_set: Any) -> None:
        horovod_set = _set(process_set)
        if hvdp_keras.is_keras_model(model):
            hvdp_keras.broadcast_state(
                model, optimizer, root_rank,
                lambda value, root, name: hvd.broadcast(value.detach(), root, name=name, process_set=horovod_set),
            )
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"broadcast_state on torch takes a torch.nn.Module or a Keras 3 model, "
                f"got {type(model).__name__}."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer for a torch module, got "
                f"{type(optimizer).__name__}."
            )
        if process_set is None:
            hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
            if optimizer is not None:
                hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
            return
        # Horovod 0.28.1's broadcast_parameters/broadcast_optimizer_state take no process set.
        handles = [hvd.broadcast_async_(tensor, root_rank, name=f"hvdp.state.{name}", process_set=horovod_set)
                   for name, tensor in sorted(model.state_dict().items())]
        for handle in handles:
            hvd.synchronize(handle)
        if optimizer is not None:
            is_root = self.rank() == root_rank
            state = hvd.broadcast_object(_cpu(optimizer.state_dict()) if is_root else None, root_rank,
                                         name="hvdp.optimizer_state", process_set=horovod_set)
            if not is_root:
                optimizer.load_state_dict(state)

    def allreduce(self, value: Any, op: str, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = _as_tensor(value, "allreduce")
        if tensor.requires_grad and torch.is_grad_enabled():  # differentiable: Horovod's autograd op
            return _same_kind(hvd.allreduce(tensor, op=_OPS[op], name=name, process_set=_set(process_set)),
                              as_numpy)
        handle = hvd.allreduce_async(tensor, op=_OPS[op], name=name, process_set=_set(process_set))
        _wait(handle)
        return _same_kind(hvd.synchronize(handle), as_numpy)

    def allgather(self, value: Any, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = _as_tensor(value, "allgather")
        return _same_kind(hvd.allgather(tensor, name=name, process_set=_set(process_set)), as_numpy)

    def broadcast(self, value: Any, root_rank: int, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = _as_tensor(value, "broadcast")
        return _same_kind(hvd.broadcast(tensor, root_rank, name=name, process_set=_set(process_set)), as_numpy)

    def broadcast_object(self, obj: Any, root_rank: int, process_set: Any) -> Any:
        return hvd.broadcast_object(obj, root_rank=root_rank, process_set=_set(process_set))

    def allgather_object(self, obj: Any, process_set: Any) -> List[Any]:
        # Horovod 0.28.1's torch allgather_object takes no process set: the same steps, with one.
        horovod_set = _set(process_set)
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        sizes = hvd.allgather(torch.tensor([data.numel()]), name="hvdp.allgather_object.sizes",
                              process_set=horovod_set).tolist()
        gathered = hvd.allgather(data, name="hvdp.allgather_object.data", process_set=horovod_set).numpy().tobytes()
        ends = list(itertools.accumulate(sizes))
        return [cloudpickle.loads(gathered[end - size:end]) for size, end in zip(sizes, ends)]

    def barrier(self, process_set: Any) -> None:
        hvd.barrier(process_set=_set(process_set))

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        if hvdp_keras.is_keras_model(model):
            return hvdp_keras.named_parameters(model, lambda value: value.detach().cpu().numpy())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a torch.nn.Module or a Keras 3 model, got {type(model).__name__}.")
        return [(name, tensor.detach().cpu().numpy()) for name, tensor in model.named_parameters()]

    def export_state(self, model: Any, optimizer: Any) -> Tuple[Dict[str, np.ndarray], Any]:
        if hvdp_keras.is_keras_model(model):
            return hvdp_keras.export_state(model, optimizer, lambda value: value.detach().cpu().numpy())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a torch.nn.Module or a Keras 3 model, got {type(model).__name__}.")
        arrays = {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}
        return arrays, None if optimizer is None else _map_tensors(optimizer.state_dict(), to_numpy=True)

    def import_state(self, model: Any, optimizer: Any, arrays: Dict[str, np.ndarray], optimizer_state: Any) -> None:
        if hvdp_keras.is_keras_model(model):
            hvdp_keras.import_state(model, optimizer, arrays, optimizer_state)
            return
        model.load_state_dict({name: torch.from_numpy(np.array(array)) for name, array in arrays.items()})
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(_map_tensors(optimizer_state, to_numpy=False))

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        # Restoring the optimizer (load_state_dict) also drops the gradient allreduces
        # Horovod's DistributedOptimizer had in flight when a collective failed.
        import horovod.torch.elastic as hvd_elastic

        return hvd_elastic.run(func)

    # Framework-specific extras (beside the neutral names).

    def sync_batch_norm(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return SyncBatchNorm(*args, **kwargs)

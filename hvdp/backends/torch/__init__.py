"""The PyTorch backend, over ``horovod.torch``: Horovod's DistributedOptimizer (C++17 build) for torch optimizers.

Its modules, by concern: :mod:`.gradients` (Horovod's gradient path, averaged when backward() returns),
:mod:`.direct` (the direct path; TensorFlow's has the same name), :mod:`.sharded` with :mod:`.sharded_buckets`,
:mod:`.sharded_state` and :mod:`.amp` (ZeRO-1), and :mod:`.keras` (Keras 3 optimizers on the torch Keras
backend, over the shared adapter :mod:`hvdp.backends.keras`).
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle
import horovod.torch as hvd
import numpy as np
import torch

from hvdp import profiler
from hvdp.backends import keras as keras_adapter
from hvdp.backends.base import REDUCE_OPS, HorovodJob, reduction_plan
from hvdp.backends.torch.direct.calls import agreeing, direct_call, leave
from hvdp.backends.torch.direct.gradients import direct_gradients, serve_until_finished
from hvdp.backends.torch.gradients import (
    HorovodPath,
    broadcast_buffers_before_forward,
    complete,
    reduce_at_backward_end,
    sparse_gradients,
)
from hvdp.backends.torch.keras import keras_optimizer
from hvdp.backends.torch.sharded import job_ranks, load_state_keeping_objects, shard, whole_for_broadcast


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


def _differentiable(tensor: torch.Tensor) -> bool:
    """Whether a collective on ``tensor`` must go through Horovod's autograd op (no handle to wait on)."""
    return tensor.requires_grad and torch.is_grad_enabled()


#: dtypes that travel through Horovod's broadcast; optimizer state of any other dtype is pickled.
_BROADCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                     torch.int32, torch.int64)


class _Slot:
    """Where a tensor stood in an optimizer's state_dict, and what it was (sent apart from the pickle)."""

    def __init__(self, index: int, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _take_tensors(tree: Any, tensors: List[torch.Tensor]) -> Any:
    """``tree`` with each broadcastable tensor replaced by a :class:`_Slot`; the tensors go to ``tensors``."""
    if torch.is_tensor(tree):
        if tree.dtype not in _BROADCAST_DTYPES or tree.numel() == 0:
            return tree.detach().cpu()
        tensors.append(tree.detach().cpu().contiguous().view(-1))
        return _Slot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {key: _take_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_take_tensors(value, tensors) for value in tree)
    return tree


def _put_tensors(tree: Any, tensors: List[torch.Tensor]) -> Any:
    """The inverse of :func:`_take_tensors`."""
    if isinstance(tree, _Slot):
        return tensors[tree.index].view(tree.shape)
    if isinstance(tree, dict):
        return {key: _put_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_put_tensors(value, tensors) for value in tree)
    return tree


def _slots(tree: Any) -> List[_Slot]:
    if isinstance(tree, _Slot):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [slot for value in values for slot in _slots(value)]


def _share_state(wrapped: torch.optim.Optimizer, original: torch.optim.Optimizer) -> None:
    """Make Horovod's new optimizer object share everything the user's optimizer holds.

    Horovod builds its DistributedOptimizer as a new object from the param groups
    alone: without this, state the optimizer already had (steps taken, or loaded to
    resume) is dropped, and ``defaults`` are the class's rather than the user's.
    Sharing the state and the group dicts (not copying them) also keeps a learning-rate
    scheduler created on the original driving the wrapper.
    """
    wrapped.param_groups, wrapped.state, wrapped.defaults = original.param_groups, original.state, original.defaults
    if hasattr(original.step, "_wrapped_by_lr_sched"):
        # A scheduler bound to the original counts the original's steps: count the wrapper's for it.
        step = wrapped.step

        def step_counted(*args: Any, **kwargs: Any) -> Any:
            original._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        wrapped.step = step_counted  # type: ignore[method-assign]


class SyncBatchNorm(hvd.SyncBatchNorm):
    """Batch norm whose batch statistics are computed over all ranks: Horovod's SyncBatchNorm.

    On GPUs it runs Horovod's CUDA sync; on CPUs (hvdp's build of Horovod) the
    per-channel sum, sum of squares and count are summed across ranks with
    Horovod's differentiable allreduce, so forward and backward equal one
    BatchNorm over the union of the ranks' batches.
    """


@agreeing  # every whole-job collective starts with the header exchange (direct.calls)
class Backend(HorovodJob):
    """hvdp's contract (:class:`hvdp.backends.base.Backend`) on PyTorch."""

    _hvd = hvd
    name = "torch"
    extras = ("sync_batch_norm", "convert_sync_batchnorm")

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
        broadcast_buffers: bool = True,
        sparse_as_dense: bool = False,
        groups: Any = None,
        shard_optimizer_state: bool = False,
    ) -> Any:
        horovod_set = self._set(process_set)
        first = job_ranks(horovod_set)[0]  # the buffers' root: the set's first rank (0 for the whole job)
        plan = reduction_plan(op, gradient_predivide_factor, self.size() if process_set is None else
                              int(process_set.size()))
        if isinstance(optimizer, torch.optim.Optimizer) and shard_optimizer_state:
            if model is not None and broadcast_buffers:
                broadcast_buffers_before_forward(model, first, horovod_set, joining=lambda: self.joining)
            name, prescale, postscale = plan
            names = {p: n for n, p in model.named_parameters()} if isinstance(model, torch.nn.Module) else {}
            return shard(optimizer, names, self._op(name), compression, prescale, postscale, horovod_set,
                         backward_passes_per_step)
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
                sparse_gradients(model, sparse_as_dense, groups)
                if broadcast_buffers:
                    broadcast_buffers_before_forward(model, first, horovod_set, joining=lambda: self.joining)
            wrapped = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named,
                compression=self._compression(compression),
                backward_passes_per_step=backward_passes_per_step,
                op=self._op(op),
                gradient_predivide_factor=gradient_predivide_factor,
                process_set=horovod_set,
                sparse_as_dense=sparse_as_dense,
                groups=groups,
            )
            _share_state(wrapped, optimizer)
            horovods = HorovodPath(wrapped)
            if op == "adasum":  # Adasum reduces the update inside step(), not the gradients
                wrapped.synchronize = profiler.timed(horovods.synchronize)
                return wrapped
            sparse = model is not None and any(getattr(m, "sparse", False) for m in model.modules())
            direct = direct_gradients(horovods, named, plan, compression, groups, horovod_set, sparse,
                                      lambda: self.joining)
            # The wait for the gradient allreduces in synchronize() is phase "sync", on either path.
            return reduce_at_backward_end(wrapped, horovods if direct is None else direct)
        if keras_adapter.is_keras_optimizer(optimizer):
            if shard_optimizer_state:
                return keras_adapter.shard_optimizer(optimizer, *plan, compression, horovod_set,
                                                     backward_passes_per_step)
            return keras_optimizer(optimizer, plan, self._op(plan[0]), compression, self._compression(compression),
                                   groups, horovod_set, backward_passes_per_step, lambda: self.joining)
        raise TypeError(
            f"hvdp.DistributedOptimizer on torch takes a torch.optim.Optimizer or a Keras 3 "
            f"optimizer (KERAS_BACKEND=torch), got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )

    def join(self) -> int:
        if not self.joining:  # the end of the job: ranks still training on the direct path get zeros from this one,
            serve_until_finished()
            leave()  # ranks still calling collectives hear that this one has finished
        return int(self._hvd.join())

    def on_step(self, optimizer: Any, callback: Callable[[Callable[[], List[Tuple[str, Any]]]], None]) -> bool:
        if not isinstance(optimizer, torch.optim.Optimizer):
            return super().on_step(optimizer, callback)  # a Keras optimizer on the torch Keras backend
        names = getattr(optimizer, "_parameter_names", {})
        parameters = getattr(optimizer, "_hvdp_parameters", None) or [
            (names.get(p, f"param_groups.{i}.{j}"), p)
            for i, group in enumerate(optimizer.param_groups) for j, p in enumerate(group["params"])]
        step = optimizer.step

        def step_then_call(_self: Any, *args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            callback(lambda: [(name, p.detach().cpu().numpy()) for name, p in parameters])
            return result

        # A method, as a learning-rate scheduler made after this expects of optimizer.step.
        optimizer.step = types.MethodType(step_then_call, optimizer)  # type: ignore[method-assign]
        return True

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int, process_set: Any) -> None:
        horovod_set = self._set(process_set)
        if keras_adapter.is_keras_model(model):
            keras_adapter.broadcast_state(
                model, optimizer, root_rank,
                lambda value, root, name: hvd.broadcast(value.detach(), root, name=name, process_set=horovod_set),
            )
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"broadcast_state on torch takes a torch.nn.Module or a Keras 3 model, "
                            f"got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer for a torch module, got "
                            f"{type(optimizer).__name__}.")
        handles = [hvd.broadcast_async_(tensor, root_rank, name=f"hvdp.state.{name}", process_set=horovod_set)
                   for name, tensor in sorted(model.state_dict().items())]
        for handle in handles:
            hvd.synchronize(handle)
        if optimizer is not None:
            self._broadcast_optimizer_state(optimizer, root_rank, horovod_set)

    def _broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, root_rank: int, horovod_set: Any) -> None:
        """Give every rank ``root_rank``'s optimizer state: hyperparameters, step counters, moments.

        Unlike Horovod's broadcast_optimizer_state, it never steps the optimizer to create
        missing state (which advanced Adam's step counter on every rank): an optimizer
        without state yet stays without it, on every rank. The structure travels pickled,
        the tensors by Horovod's broadcast; the root's optimizer is left untouched.
        """
        is_root = self.rank() == root_rank
        tensors: List[torch.Tensor] = []
        whole = whole_for_broadcast(optimizer, is_root, lambda flag: self.broadcast_object(
            flag, root_rank, horovod_set, name="hvdp.optimizer_state.loaded"))  # sharded: not the root's part only
        skeleton = _take_tensors(optimizer.state_dict() if whole is None else whole, tensors) if is_root else None
        skeleton = self.broadcast_object(skeleton, root_rank, horovod_set, name="hvdp.optimizer_state")
        if not is_root:
            tensors = [torch.empty(int(np.prod(slot.shape)), dtype=slot.dtype)
                       for slot in sorted(_slots(skeleton), key=lambda slot: slot.index)]
        handles = [hvd.broadcast_async_(tensor, root_rank, name=f"hvdp.optimizer_state.{i}", process_set=horovod_set)
                   for i, tensor in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)
        if not is_root:
            load_state_keeping_objects(optimizer, _put_tensors(skeleton, tensors))

    def _to_tensor(self, value: Any, caller: str) -> Tuple[Any, bool]:
        if isinstance(value, torch.Tensor):
            return value, False
        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(value)), True
        raise TypeError(
            f"{caller} on torch takes a torch.Tensor, a NumPy array or a Python number, got {type(value).__name__}."
        )

    def _from_tensor(self, result: Any, as_numpy: bool) -> Any:
        return result.detach().numpy() if as_numpy else result

    def allreduce(self, value: Any, op: str, name: Optional[str], process_set: Any, out: Any = None) -> Any:
        tensor, as_numpy = self._to_tensor(value, "allreduce")
        horovod_op, horovod_set = self._op(op), self._set(process_set)
        target = out if out is None or not isinstance(out, np.ndarray) else torch.from_numpy(out)
        grad = _differentiable(tensor)  # the header exchange, then direct Gloo calls where every rank can
        with torch.no_grad():
            direct = direct_call(tensor, op, name, process_set is None, self.joining, target, grad)
        if direct is not None:
            return out if out is not None else self._from_tensor(direct, as_numpy)
        if out is not None:  # in place in out: no result tensor to allocate, fault in and free per call
            target = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
            with torch.no_grad():
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
                complete(hvd.allreduce_async_(target, op=horovod_op, name=name, process_set=horovod_set))
            return out
        if _differentiable(tensor):
            self._check_reduced([tensor], op, "allreduce")
            return self._from_tensor(hvd.allreduce(tensor, op=horovod_op, name=name, process_set=horovod_set),
                                     as_numpy)
        return self._from_tensor(complete(hvd.allreduce_async(tensor, op=horovod_op, name=name,
                                                               process_set=horovod_set)), as_numpy)

    def _check_reduced(self, tensors: List[Any], op: str, caller: str) -> None:
        if op not in REDUCE_OPS and any(_differentiable(tensor) for tensor in tensors):
            raise ValueError(
                f"hvdp.{caller}(op={op!r}) of a tensor that requires grad: Horovod's {caller} has a gradient "
                f"for average and sum only. Reduce tensor.detach(), or run it under torch.no_grad().")

    def allgather(self, value: Any, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = self._to_tensor(value, "allgather")
        if _differentiable(tensor):
            return super().allgather(value, name, process_set)
        return self._from_tensor(complete(hvd.allgather_async(tensor, name=name, process_set=self._set(process_set))),
                                 as_numpy)

    def broadcast(self, value: Any, root_rank: int, name: Optional[str], process_set: Any) -> Any:
        tensor, as_numpy = self._to_tensor(value, "broadcast")
        if _differentiable(tensor):
            return super().broadcast(value, root_rank, name, process_set)
        return self._from_tensor(complete(hvd.broadcast_async(tensor, root_rank, name=name,
                                                               process_set=self._set(process_set))), as_numpy)

    def allgather_object(self, obj: Any, process_set: Any) -> List[Any]:
        # Horovod 0.28.1's torch allgather_object takes no process set: the same steps, with one.
        horovod_set = self._set(process_set)
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        sizes = hvd.allgather(torch.tensor([data.numel()]), name="hvdp.allgather_object.sizes",
                              process_set=horovod_set).tolist()
        gathered = hvd.allgather(data, name="hvdp.allgather_object.data", process_set=horovod_set).numpy().tobytes()
        ends = list(itertools.accumulate(sizes))
        return [cloudpickle.loads(gathered[end - size:end]) for size, end in zip(sizes, ends)]

    def barrier(self, process_set: Any) -> None:
        hvd.barrier(process_set=self._set(process_set))

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        if keras_adapter.is_keras_model(model):
            return keras_adapter.named_parameters(model, lambda value: value.detach().cpu().numpy())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a torch.nn.Module or a Keras 3 model, got {type(model).__name__}.")
        return [(name, tensor.detach().cpu().numpy()) for name, tensor in model.named_parameters()]

    def export_state(self, model: Any, optimizer: Any) -> Tuple[Dict[str, np.ndarray], Any]:
        if keras_adapter.is_keras_model(model):
            return keras_adapter.export_state(model, optimizer, lambda value: value.detach().cpu().numpy())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a torch.nn.Module or a Keras 3 model, got {type(model).__name__}.")
        arrays = {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}
        return arrays, None if optimizer is None else _map_tensors(optimizer.state_dict(), to_numpy=True)

    def import_state(self, model: Any, optimizer: Any, arrays: Dict[str, np.ndarray], optimizer_state: Any) -> None:
        if keras_adapter.is_keras_model(model):
            keras_adapter.import_state(model, optimizer, arrays, optimizer_state)
            return
        model.load_state_dict({name: torch.from_numpy(np.array(array)) for name, array in arrays.items()})
        if optimizer is not None and optimizer_state is not None:
            load_state_keeping_objects(optimizer, _map_tensors(optimizer_state, to_numpy=False))

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        # Restoring the optimizer (load_state_dict) also drops the gradient allreduces
        # Horovod's DistributedOptimizer had in flight when a collective failed.
        import horovod.torch.elastic as hvd_elastic

        return hvd_elastic.run(func)

    # Framework-specific extras (beside the neutral names).

    def sync_batch_norm(self, num_features: int, **kwargs: Any) -> torch.nn.Module:
        return SyncBatchNorm(num_features, **kwargs)

    def convert_sync_batchnorm(self, module: Any) -> Any:
        # As torch.nn.SyncBatchNorm.convert_sync_batchnorm: the same parameters (objects, so an
        # optimizer made before still trains them), running statistics and mode; torch's own
        # SyncBatchNorm, which needs torch.distributed, is converted too.
        batch_norm = torch.nn.modules.batchnorm._BatchNorm
        if isinstance(module, batch_norm) and not isinstance(module, SyncBatchNorm):
            converted = SyncBatchNorm(module.num_features, eps=module.eps, momentum=module.momentum,
                                      affine=module.affine, track_running_stats=module.track_running_stats)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            if module.track_running_stats:
                converted.running_mean, converted.running_var = module.running_mean, module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, self.convert_sync_batchnorm(child))
        return module

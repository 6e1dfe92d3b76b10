"""ZeRO stage 1 on torch: each replica keeps the optimizer state of 1/N of the parameters.

``hvdp.DistributedOptimizer(opt, model, shard_optimizer_state=True)``. Each param group's
parameters and gradients become views of two flat buffers (autograd accumulates into the
gradient views), cut into buckets (:mod:`hvdp.backends.torch.sharded_buckets`). Rank r of n owns
the elements :func:`bounds` gives of each bucket, the part reducescatter hands it. Backward
reduce-scatters each bucket as its gradients are ready; ``step()`` waits for them, steps the
user's optimizer on views of this rank's part (in chunks: its state is 1/n of the model's),
then each rank broadcasts its updated part in place: every replica holds the whole model.
torch's built-in optimizers update each element from that element alone, so the step is
the unsharded one. ``state_dict()`` gathers the whole state in torch's unsharded format (a
collective), and ``load_state_dict`` takes one saved at any number of ranks, or unsharded.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import horovod.torch as hvd
import torch

from hvdp import profiler
from hvdp.backends.base import bounds
from hvdp.backends.torch import sharded_state
from hvdp.backends.torch.amp import agree_on_overflow
from hvdp.backends.torch.gradients import complete
from hvdp.backends.torch.sharded_buckets import Bucket, Reducer, on_the_wire, plan, send_bucket

#: Elements per chunk of a rank's part (1 MiB of float32): each chunk is one parameter of the optimizer.
CHUNK = 1 << 18
#: torch's optimizers whose update of an element reads that element's gradient and state only.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD",
               "Rprop")


def load_state_keeping_objects(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any],
                               load: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    """``optimizer.load_state_dict(state_dict)`` (or ``load(state_dict)``), keeping the optimizer's ``state``
    and param-group objects.

    torch's ``load_state_dict`` replaces them with new ones; a learning-rate scheduler
    (or the original optimizer a :func:`hvdp.DistributedOptimizer` shares them with)
    holds the old ones and would stop driving this optimizer.
    """
    groups, state = optimizer.param_groups, optimizer.state
    (load or optimizer.load_state_dict)(state_dict)
    for old, new in zip(groups, optimizer.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    loaded = optimizer.state
    if loaded is not state:
        state.clear()
        state.update(loaded)
    optimizer.param_groups, optimizer.state = groups, state


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer the flat parts would change, naming it and the fix."""
    name = type(optimizer).__name__
    if name not in ELEMENTWISE:
        raise ValueError(
            f"hvdp.DistributedOptimizer(shard_optimizer_state=True) takes torch's elementwise optimizers "
            f"({', '.join(ELEMENTWISE)}), got {type(optimizer).__module__}.{name}: each rank steps a slice of the "
            f"flattened parameters, which would change a rule that reads a whole tensor (LBFGS's line search, "
            f"LAMB's or LARS's per-tensor norms). Fix: shard_optimizer_state=False.")
    for i, group in enumerate(optimizer.param_groups):
        kinds = {(p.dtype, p.device) for p in group["params"]}
        if len(kinds) > 1:
            raise ValueError(
                f"hvdp.DistributedOptimizer(shard_optimizer_state=True): param group {i} mixes "
                f"{sorted(str(k) for k in kinds)}; each group is laid out in one buffer. Fix: put the parameters "
                f"of each dtype and device in a param group of their own.")


class Shards:
    """The flat buffers of parameters and gradients, this rank's parts of them, and a sharded step's collectives."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Dict[Any, str], op: Any, compression: str,
                 prescale: float, postscale: float, process_set: Any, passes_per_step: int = 1) -> None:
        self.optimizer, self.op, self.compression, self.set = optimizer, op, compression, process_set
        self.prescale, self.postscale = prescale, postscale
        self.params: List[List[torch.nn.Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        self.named = [(names.get(p, f"param_groups.{g}.{i}"), p)
                      for g, params in enumerate(self.params) for i, p in enumerate(params)]
        self.flats: List[torch.Tensor] = []  # the parameters, each a view of its group's buffer
        self.grads: List[torch.Tensor] = []  # their gradients, the same way (autograd accumulates into them)
        for params in self.params:
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            self.flats.append(flat)
            self.grads.append(torch.zeros_like(flat))
            for p, view in zip(params, self.views(flat, params)):
                p.data = view
        self.attach_grads(zero=False)
        self.buckets = plan([[p.numel() for p in params] for params in self.params])
        self.reducer = Reducer(self.params, self.grads, self.buckets, self.views, self.send,
                               lambda: self.attach_grads(zero=True), self.lay_out, passes_per_step)
        self.members, self.index = -1, -1
        self.parts: List[List[torch.nn.Parameter]] = []  # per group: this rank's part, in chunks
        self.chunked: List[List[Tuple[int, int]]] = []  # per group and chunk: its bucket, its offset in the part
        self.reduced = False  # this step's gradients are reduced into the parts' .grad
        self.loaded: Optional[Dict[str, Any]] = None  # the whole state last loaded, until the next step

    @staticmethod
    def views(flat: torch.Tensor, params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        return [flat[offsets[i]:offsets[i + 1]].view_as(p) for i, p in enumerate(params)]

    def attach_grads(self, zero: bool) -> None:
        """Make every parameter's ``.grad`` its view of the gradient buffer (copying a gradient made elsewhere)."""
        for params, grads in zip(self.params, self.grads):
            for p, view in zip(params, self.views(grads, params)):
                if p.grad is None:
                    if zero:
                        view.zero_()
                elif p.grad.data_ptr() != view.data_ptr() or p.grad.is_sparse:
                    view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)  # after model.zero_grad()
                p.grad = view

    def lay_out(self, loading: bool = False) -> None:
        """Give this rank its parts for the current world (once, and again when the world changes)."""
        members, index = self.set.size(), self.set.rank()  # in the process set (the job's by default)
        if (members, index) == (self.members, self.index):
            return
        self.reducer.reset()
        self.reducer.active = members > 1
        if self.members > 0 and self.optimizer.state and not loading:
            raise RuntimeError(
                f"hvdp: the ranks changed ({self.members} -> {members}) and this rank's optimizer state belongs to the "
                f"old parts. Fix: load the whole state again (opt.load_state_dict(whole); hvdp.load_checkpoint "
                f"does).")
        self.members, self.index = members, index
        self.parts, self.chunked = [], []
        for g, (flat, group) in enumerate(zip(self.flats, self.optimizer.param_groups)):
            # Views (stepping them updates the model), in chunks: torch's optimizers run faster on tensors
            # of about 1 MB than on one of a whole model (Adam on ResNet-18: 28 ms against 63 on one core).
            chunks, where = [], []
            for b, bucket in enumerate(self.buckets):
                if bucket.group == g:
                    start, end = self.segment(bucket, index)
                    for i in range(start, end, CHUNK):
                        chunks.append(torch.nn.Parameter(flat[i:min(i + CHUNK, end)]))
                        where.append((b, i - start))
            group["params"] = chunks or [torch.nn.Parameter(flat[0:0])]
            self.parts.append(group["params"])
            self.chunked.append(where or [(-1, 0)])
        self.optimizer.state.clear()
        self.reduced = False

    def segment(self, bucket: Bucket, index: int) -> Tuple[int, int]:
        """Rank ``index``'s range of its group's buffer in ``bucket``."""
        start, end = bounds(bucket.end - bucket.start, self.members, index)
        return bucket.start + start, bucket.start + end

    def segments(self, g: int, index: int) -> List[Tuple[int, int]]:
        """Rank ``index``'s part of group ``g``'s buffer: its range in each bucket, in order."""
        return [self.segment(bucket, index) for bucket in self.buckets if bucket.group == g]

    def in_buffer_order(self, g: int, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's part of group ``g``, end to end in rank order (an allgather), in the buffer's order."""
        out, offset = torch.empty_like(gathered), 0
        for rank in range(self.members):
            for start, end in self.segments(g, rank):
                out[start:end] = gathered[offset:offset + end - start]
                offset += end - start
        return out

    def send(self, b: int) -> Any:
        bucket = self.buckets[b]
        return send_bucket(self.grads[bucket.group], bucket, self.compression, self.op, self.prescale,
                           self.postscale, self.set, f"hvdp.zero.gradients.{b}")

    def check_views(self) -> None:
        """The parameters must still be views of the buffers (``model.to()`` or ``p.data = ...`` replaces them)."""
        for name, p in self.named:
            if not any(p.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                       for flat in self.flats):
                raise RuntimeError(
                    f"hvdp.DistributedOptimizer(shard_optimizer_state=True): parameter {name} no longer shares the "
                    f"optimizer's buffer (moved with .to() or reassigned after the optimizer was made), so a step "
                    f"would not reach it. Fix: move the model first, then make the optimizer.")

    def reduce(self) -> None:
        """This step's reduced gradients: the parts' ``.grad``, from the buckets' reducescatters.

        Those backward started if its last pass sent every bucket; otherwise (fewer passes
        than ``backward_passes_per_step``, gradients set by hand, one rank) sent now.
        """
        if self.reduced:
            return
        self.lay_out()
        self.check_views()
        reducer, scale = self.reducer, self.prescale * self.postscale
        if self.members == 1:  # one rank: its part is the whole buffer, and the reduction its own gradient
            self.attach_grads(zero=True)
            reduced = {}
            for b, bucket in enumerate(self.buckets):
                view = self.grads[bucket.group][bucket.start:bucket.end]
                one = on_the_wire(view, self.compression)
                reduced[b] = view if one is view and scale == 1.0 else (one * scale).to(view.dtype)
        elif reducer.sent():
            reducer.check_unchanged(dict((p, n) for n, p in self.named))
            reduced = reducer.take()
        else:
            reducer.drop()
            self.attach_grads(zero=True)
            reducer.pending = {b: self.send(b) for b in range(len(self.buckets))}
            reduced = reducer.take()
        for b, part in reduced.items():
            start, end = self.segment(self.buckets[b], self.index)
            if part.numel() != end - start:
                raise RuntimeError(f"hvdp: reducescatter gave this rank {part.numel()} gradient elements for a "
                                   f"part of {end - start}; the ranks split the buckets differently.")
            dtype = self.grads[self.buckets[b].group].dtype
            reduced[b] = part if part.dtype == dtype else part.to(dtype)
        for chunks, where in zip(self.parts, self.chunked):
            for chunk, (b, offset) in zip(chunks, where):
                chunk.grad = reduced[b][offset:offset + chunk.numel()] if b >= 0 else torch.zeros_like(chunk)
        self.reduced = True

    def gather(self) -> None:
        """Give every rank every part: each rank broadcasts its part of each buffer, in place."""
        if self.members == 1:
            return  # the part is the whole buffer: stepped in place
        handles, ranks = [], job_ranks(self.set)
        for b, bucket in enumerate(self.buckets):
            for rank in range(self.members):  # a broadcast's root is a rank of the job
                start, end = self.segment(bucket, rank)
                if end > start:
                    handles.append(hvd.broadcast_async_(self.flats[bucket.group][start:end], ranks[rank],
                                                        name=f"hvdp.zero.part.{b}.{rank}", process_set=self.set))
        if handles:
            complete(*handles)

    whole_state = sharded_state.whole_state
    part_state = sharded_state.part_state

    def zero_grad(self) -> None:
        """Zero the gradient buffers; every ``.grad`` stays their view (``set_to_none`` would undo the views)."""
        self.reducer.drop()  # a backward's reduction no step took
        self.reducer.passes = 0
        for grads in self.grads:
            grads.zero_()
        self.attach_grads(zero=False)
        for chunks in self.parts:
            for chunk in chunks:
                chunk.grad = None
        self.reduced = False

class ShardedStep:
    """The methods a sharded optimizer's class gets over the user's optimizer class."""

    _hvdp_shards: Shards
    param_groups: List[Dict[str, Any]]
    state: Dict[Any, Any]

    @property
    def _hvdp_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self._hvdp_shards.named

    def step(self, closure: Any = None) -> Any:
        shards = self._hvdp_shards
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with profiler.phase("sync"):
            shards.reduce()
        super().step()  # type: ignore[misc]
        with profiler.phase("sync"):
            shards.gather()
        shards.reduced, shards.loaded = False, None
        self._opt_called = True  # what a learning-rate scheduler's check looks for
        return loss

    def synchronize(self) -> None:
        self._hvdp_shards.reduce()  # now: step() does not reduce them again

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield  # step() reduces once a step whichever way

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in this block accumulate ``.grad`` locally; the next one outside reduces the sum."""
        reducer = self._hvdp_shards.reducer
        if reducer.local:
            raise RuntimeError("optimizer.no_sync() blocks do not nest; leave the open one first.")
        reducer.local = True
        try:
            yield
        finally:
            reducer.local, reducer.passes = False, 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; ``.grad`` stays allocated (a view of the gradient buffer) whatever ``set_to_none``."""
        self._hvdp_shards.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients to a total norm of ``max_norm`` over the whole model; the norm before.

        With sharded state each rank holds its part of the reduced gradient, so
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would clip this rank's own
        gradient: call this instead, between ``backward()`` and ``step()`` (as FSDP's).
        """
        shards = self._hvdp_shards
        shards.reduce()
        grads = [chunk.grad for chunks in shards.parts for chunk in chunks if chunk.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() if g.numel() else torch.zeros(()) for g in grads]).max()
            total = hvd.allreduce(local.reshape(1), op=hvd.Max, name="hvdp.zero.norm", process_set=shards.set)[0]
        else:
            local = torch.stack([(g.double().abs() ** norm_type).sum() for g in grads]).sum() if grads else \
                torch.zeros((), dtype=torch.float64)
            total = hvd.allreduce(local.reshape(1), op=hvd.Sum, name="hvdp.zero.norm",
                                  process_set=shards.set)[0] ** (1.0 / norm_type)
        coefficient = float(max_norm) / (float(total) + 1e-6)
        if coefficient < 1.0:
            for g in grads:
                g.mul_(coefficient)
        return total.float()

    def state_dict(self) -> Dict[str, Any]:
        """The whole optimizer state, every rank's part gathered (call it on every rank), in torch's format."""
        self._hvdp_shards.lay_out()
        return self._hvdp_shards.whole_state(super().state_dict())  # type: ignore[misc]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's part of a whole state (from ``state_dict()`` at any world size, or unsharded)."""
        shards = self._hvdp_shards
        shards.lay_out(loading=True)
        load_state_keeping_objects(self, shards.part_state(state_dict), super().load_state_dict)  # type: ignore
        shards.loaded = state_dict


def shard(optimizer: torch.optim.Optimizer, names: Dict[Any, str], op: Any, compression: str, prescale: float,
          postscale: float, process_set: Any, passes_per_step: int = 1) -> torch.optim.Optimizer:
    """``optimizer`` sharded over Horovod's ``process_set`` (module docstring): same class name and isinstance."""
    check_optimizer(optimizer)
    agree_on_overflow()  # AMP's GradScaler: reduced before it unscales, and skipped steps agreed
    existing = optimizer.state_dict() if optimizer.state else None
    cls = type(type(optimizer).__name__, (ShardedStep, type(optimizer)), {"__module__": type(optimizer).__module__})
    sharded: Any = object.__new__(cls)
    sharded.__dict__ = optimizer.__dict__  # one object's state: a scheduler made on the original drives both
    if getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        del optimizer.__dict__["step"]  # a scheduler's wrapper of the original's step, which would bypass the parts
    shards = Shards(optimizer, names, op, compression, prescale, postscale, process_set, passes_per_step)
    sharded._hvdp_shards = shards
    shards.lay_out()
    if existing is not None:
        sharded.load_state_dict(existing)
    return sharded


def job_ranks(process_set: Any) -> List[int]:
    """The job ranks of Horovod's ``process_set``, in its order (a broadcast's root is one of them)."""
    return list(range(hvd.size())) if process_set.process_set_id == 0 else list(process_set.ranks)


def whole_for_broadcast(optimizer: Any, is_root: bool, agree: Any) -> Optional[Dict[str, Any]]:
    """What :func:`hvdp.broadcast_state` sends of a sharded optimizer from the root.

    The whole state the root last loaded (a checkpoint, an elastic restore), if it did;
    otherwise the live state gathered from every rank's part. ``agree(flag)`` is the
    root's flag on every rank. None: not a sharded optimizer.
    """
    shards: Optional[Shards] = getattr(optimizer, "_hvdp_shards", None)
    if shards is None:
        return None
    shards.lay_out()
    if agree(is_root and shards.loaded is not None):
        return shards.loaded if is_root else {}
    return optimizer.state_dict()

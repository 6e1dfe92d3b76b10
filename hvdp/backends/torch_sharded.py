"""ZeRO stage 1 on torch: each replica keeps the optimizer state of 1/N of the parameters.

``hvdp.DistributedOptimizer(opt, model, shard_optimizer_state=True)``. The parameters of
each param group are laid out in one flat buffer (each parameter becomes a view of it, so
the model, its ``state_dict()`` and a broadcast read and write that memory). Rank r of n
owns the elements :func:`bounds` gives of each buffer, the part reducescatter hands it
(the first ``total % n`` ranks one element more). ``step()``:

1. reduce-scatters each group's flattened gradients: this rank gets the reduced gradient of
   its part only;
2. steps the user's optimizer on a parameter that is a view of that part, so its state
   (Adam's two moments) is 1/n of the model's size;
3. all-gathers the updated parts into the buffers: every replica holds the whole model.

torch's built-in optimizers update each element from that element alone, so the step is
the one an unsharded optimizer takes. ``state_dict()`` gathers the whole state in torch's
unsharded format (a collective: every rank calls it), and ``load_state_dict`` takes such a
state on any number of ranks and keeps this rank's part: checkpoints move between world
sizes and to and from unsharded optimizers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import horovod.torch as hvd
import torch

from hvdp import profiler
from hvdp.backends.torch_gradients import complete

#: torch's optimizers whose update of an element reads that element's gradient and state only.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD",
               "Rprop")


def bounds(total: int, members: int, index: int) -> Tuple[int, int]:
    """Elements ``[start, end)`` of a flat buffer of ``total`` that rank ``index`` of ``members`` owns.

    Example:
        >>> [bounds(10, 3, r) for r in range(3)]
        [(0, 4), (4, 7), (7, 10)]
    """
    share, extra = divmod(total, members)
    start = index * share + min(index, extra)
    return start, start + share + (index < extra)


def load_state_keeping_objects(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping the optimizer's ``state`` and param-group objects.

    torch's ``load_state_dict`` replaces them with new ones; a learning-rate scheduler
    (or the original optimizer a :func:`hvdp.DistributedOptimizer` shares them with)
    holds the old ones and would stop driving this optimizer.
    """
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.load_state_dict(state_dict)
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
    """The flat buffers, this rank's parts of them, and the collectives of a sharded step."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Dict[Any, str], op: Any, compression: str,
                 prescale: float, postscale: float, process_set: Any) -> None:
        self.optimizer, self.op, self.compression = optimizer, op, compression
        self.prescale, self.postscale, self.process_set = prescale, postscale, process_set
        self.params: List[List[torch.nn.Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        self.named = [(names.get(p, f"param_groups.{g}.{i}"), p)
                      for g, params in enumerate(self.params) for i, p in enumerate(params)]
        self.flats: List[torch.Tensor] = []
        for params in self.params:
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            offset = 0
            for p in params:
                p.data = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats.append(flat)
        self.members, self.index = -1, -1
        self.parts: List[torch.nn.Parameter] = []
        self.reduced = False  # this step's gradients are reduced into the parts' .grad
        self.loaded: Optional[Dict[str, Any]] = None  # the whole state last loaded, until the next step
        self.suffix = f".s{getattr(process_set, 'process_set_id', 0)}"

    def world(self) -> Tuple[int, int]:
        if self.process_set is None or self.process_set == hvd.global_process_set:
            return hvd.size(), hvd.rank()
        return self.process_set.size(), self.process_set.rank()

    def lay_out(self, loading: bool = False) -> None:
        """Give this rank its parts for the current world (once, and again when the world changes)."""
        members, index = self.world()
        if (members, index) == (self.members, self.index):
            return
        if self.members > 0 and self.optimizer.state and not loading:
            raise RuntimeError(
                f"hvdp: the ranks changed ({self.members} -> {members}) and this rank's optimizer state belongs to the "
                f"old parts. Fix: load the whole state again (opt.load_state_dict(whole); hvdp.elastic.State and "
                f"hvdp.load_checkpoint do).")
        self.members, self.index = members, index
        self.parts = []
        for flat, group in zip(self.flats, self.optimizer.param_groups):
            start, end = bounds(flat.numel(), members, index)
            part = torch.nn.Parameter(flat[start:end])  # a view: stepping it updates the model
            group["params"] = [part]
            self.parts.append(part)
        self.optimizer.state.clear()
        self.reduced = False

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
        """Reduce-scatter this step's gradients into the parts' ``.grad`` (once a step)."""
        if self.reduced:
            return
        self.lay_out()
        self.check_views()
        grads = []
        for params, flat in zip(self.params, self.flats):
            pieces = [torch.zeros(p.numel(), dtype=flat.dtype) if p.grad is None else
                      (p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1) for p in params]
            grad = torch.cat(pieces) if pieces else torch.zeros(0, dtype=flat.dtype)
            grads.append(grad.half() if self.compression == "fp16" and grad.is_floating_point() else grad)
        handle = hvd.grouped_reducescatter_async(
            grads, name=f"hvdp.zero.gradients{self.suffix}", op=self.op, process_set=self.process_set or
            hvd.global_process_set, prescale_factor=self.prescale, postscale_factor=self.postscale)
        reduced = complete(handle)
        for part, grad in zip(self.parts, reduced):
            if grad.numel() != part.numel():
                raise RuntimeError(f"hvdp: reducescatter gave this rank {grad.numel()} gradient elements for a part of "
                                   f"{part.numel()}; the ranks split the buffers differently.")
            part.grad = grad.to(part.dtype)
        self.reduced = True

    def gather(self) -> None:
        """All-gather the updated parts into the buffers."""
        handle = hvd.grouped_allgather_async([part.detach() for part in self.parts],
                                             name=f"hvdp.zero.parameters{self.suffix}",
                                             process_set=self.process_set or hvd.global_process_set)
        with torch.no_grad():
            for flat, whole in zip(self.flats, complete(handle)):
                flat.copy_(whole)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params in self.params + [self.parts]:
            for p in params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self.reduced = False

    # The whole state, in torch's unsharded format.

    def whole_state(self, local: Dict[str, Any]) -> Dict[str, Any]:
        """Every rank's part of each state tensor, gathered (a collective); ``local`` is the parts' state_dict."""
        keys = sorted({key for g in range(len(self.parts)) for key in local["state"].get(g, {})})
        gathered: List[torch.Tensor] = []
        requests = []
        for g, part in enumerate(self.parts):
            state = local["state"].get(g, {})
            for key in keys:
                value = state.get(key)
                if torch.is_tensor(value) and value.dim() == 1 and value.shape == part.shape:
                    requests.append((g, key))
                    gathered.append(value.detach())
        wholes = complete(hvd.grouped_allgather_async(gathered, name=f"hvdp.zero.state{self.suffix}",
                                                      process_set=self.process_set or hvd.global_process_set)
                          ) if gathered else []
        by_request = dict(zip(requests, wholes))
        state_out: Dict[int, Dict[str, Any]] = {}
        groups_out = []
        index = 0
        for g, (params, group) in enumerate(zip(self.params, local["param_groups"])):
            state = local["state"].get(g, {})
            offset = 0
            ids = []
            for p in params:
                entry = {}
                for key, value in state.items():
                    whole = by_request.get((g, key))
                    entry[key] = value if whole is None else whole[offset:offset + p.numel()].view_as(p).clone()
                if entry:
                    state_out[index] = entry
                ids.append(index)
                offset += p.numel()
                index += 1
            groups_out.append({**group, "params": ids})
        return {"state": state_out, "param_groups": groups_out}

    def part_state(self, whole: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's part of ``whole`` (torch's unsharded format), as the parts' state_dict."""
        groups = whole.get("param_groups", [])
        if [len(group["params"]) for group in groups] != [len(params) for params in self.params]:
            raise ValueError(
                f"hvdp: the optimizer state holds param groups of {[len(g['params']) for g in groups]} parameters, "
                f"this optimizer {[len(params) for params in self.params]}. Load a state saved by the same model "
                f"and optimizer.")
        state_in = {int(key): value for key, value in whole.get("state", {}).items()}
        state_out: Dict[int, Dict[str, Any]] = {}
        for g, (params, group) in enumerate(zip(self.params, groups)):
            entries = [state_in.get(int(i), {}) for i in group["params"]]
            keys = sorted({key for entry in entries for key in entry})
            if not keys:
                continue
            missing = [n for n, entry in enumerate(entries) if set(entry) != set(keys)]
            if missing:
                raise ValueError(f"hvdp: param group {g} has optimizer state for some parameters only (none or other "
                                 f"keys for parameter {missing[0]}); a sharded optimizer keeps one state per group.")
            start, end = bounds(sum(p.numel() for p in params), self.members, self.index)
            out: Dict[str, Any] = {}
            for key in keys:
                values = [entry[key] for entry in entries]
                if all(torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0 for v, p in zip(values, params)):
                    out[key] = torch.cat([v.reshape(-1) for v in values])[start:end].clone()
                else:
                    out[key] = values[0]  # a counter the parameters share (Adam's step)
            state_out[g] = out
        groups_out = [{**group, "params": [g]} for g, group in enumerate(groups)]
        return {"state": state_out, "param_groups": groups_out}


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
        """Reduce this step's gradients now (``step()`` then does not reduce them again)."""
        self._hvdp_shards.reduce()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield  # step() reduces once a step whichever way

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing is reduced before step(): every backward pass accumulates locally

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._hvdp_shards.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients to a total norm of ``max_norm`` over the whole model; the norm before.

        With sharded state each rank holds its part of the reduced gradient, so
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would clip this rank's own
        gradient: call this instead, between ``backward()`` and ``step()`` (as FSDP's).
        """
        shards = self._hvdp_shards
        shards.reduce()
        grads = [part.grad for part in shards.parts if part.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() if g.numel() else torch.zeros(()) for g in grads]).max()
            total = hvd.allreduce(local.reshape(1), op=hvd.Max, name=f"hvdp.zero.norm{shards.suffix}",
                                  process_set=shards.process_set or hvd.global_process_set)[0]
        else:
            local = torch.stack([(g.double().abs() ** norm_type).sum() for g in grads]).sum() if grads else \
                torch.zeros((), dtype=torch.float64)
            total = hvd.allreduce(local.reshape(1), op=hvd.Sum,
                                  name=f"hvdp.zero.norm{shards.suffix}",
                                  process_set=shards.process_set or hvd.global_process_set)[0] ** (1.0 / norm_type)
        coefficient = float(max_norm) / (float(total) + 1e-6)
        if coefficient < 1.0:
            for g in grads:
                g.mul_(coefficient)
        return total.float()

    def state_dict(self) -> Dict[str, Any]:
        """The whole optimizer state, every rank's part gathered (call it on every rank), in torch's format."""
        shards = self._hvdp_shards
        shards.lay_out()
        return shards.whole_state(super().state_dict())  # type: ignore[misc]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's part of a whole state (from ``state_dict()`` at any world size, or unsharded)."""
        shards = self._hvdp_shards
        shards.lay_out(loading=True)
        groups, state = self.param_groups, self.state
        super().load_state_dict(shards.part_state(state_dict))  # type: ignore[misc]
        for old, new, part in zip(groups, self.param_groups, shards.parts):
            old.clear()
            old.update(new)
            old["params"] = [part]
        loaded = self.state
        if loaded is not state:
            state.clear()
            state.update(loaded)
        self.param_groups, self.state = groups, state
        shards.loaded = state_dict


def shard(optimizer: torch.optim.Optimizer, names: Dict[Any, str], op: Any, compression: str, prescale: float,
          postscale: float, process_set: Any) -> torch.optim.Optimizer:
    """``optimizer`` sharded over the ranks of ``process_set`` (module docstring): same class name and isinstance."""
    check_optimizer(optimizer)
    existing = optimizer.state_dict() if optimizer.state else None
    cls = type(type(optimizer).__name__, (ShardedStep, type(optimizer)), {"__module__": type(optimizer).__module__})
    sharded: Any = object.__new__(cls)
    sharded.__dict__ = optimizer.__dict__  # one object's state: a scheduler made on the original drives both
    if getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        del optimizer.__dict__["step"]  # a scheduler's wrapper of the original's step, which would bypass the parts
    shards = Shards(optimizer, names, op, compression, prescale, postscale, process_set)
    sharded._hvdp_shards = shards
    shards.lay_out()
    if existing is not None:
        sharded.load_state_dict(existing)
    return sharded


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

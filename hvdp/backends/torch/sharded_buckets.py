"""A sharded torch optimizer's gradient buckets, reduce-scattered while backward still runs.

Each param group's flat gradient buffer is cut, at parameter boundaries, into buckets
counted from its last parameter (backward makes the last layers' gradients first): the
first of about :data:`FIRST` elements, the others of about :data:`BUCKET`. Rank r of n owns
``bounds(len, n, r)`` of every bucket, the part Horovod's reducescatter of that bucket
hands it. A parameter's post-accumulate-grad hook counts its bucket's gradients; the last
one sends the bucket, so the reduction overlaps with the rest of backward, as DDP's
reducer does. At the end of the backward pass that completes ``backward_passes_per_step``
passes (autograd's ``queue_callback``), the buckets not sent yet (a parameter this pass did
not use) are sent; ``step()`` waits for them. As under DDP, each such pass is a collective.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import horovod.torch as hvd
import torch

from hvdp.backends.torch.buckets import Filler
from hvdp.backends.torch.gradients import complete, wake


class Bucket(NamedTuple):
    group: int  # its param group
    start: int  # its range of the group's flat buffer
    end: int
    params: Tuple[int, ...]  # the group's parameters in it, by index


def plan(sizes: List[List[int]], first: Optional[int] = None, limit: Optional[int] = None) -> List[Bucket]:
    """The buckets of param groups whose parameters have ``sizes`` elements, in each group's buffer order: cut
    by :class:`hvdp.backends.torch.buckets.Filler` from each group's last parameter (``first`` and ``limit``
    its bounds, the planner's own by default)."""
    buckets: List[Bucket] = []
    for g, group in enumerate(sizes):
        offsets = [0]
        for size in group:
            offsets.append(offsets[-1] + size)
        filler: Filler[int] = Filler(first, limit)
        runs = [run for i in reversed(range(len(group))) if (run := filler.add(i, group[i])) is not None]
        if filler.items:
            runs.append(filler.rest())
        for run in reversed(runs):  # each run from its last parameter down: the buffer's order again
            buckets.append(Bucket(g, offsets[run[-1]], offsets[run[0] + 1], tuple(reversed(run))))
    return buckets


class Reducer:
    """The buckets' reducescatters of one sharded optimizer, started from gradient hooks (module docstring).

    ``send(b)`` starts bucket ``b``'s reducescatter and returns its handle; ``attach()``
    makes every ``.grad`` its view of the buffer (zeros where a parameter has none);
    ``start()`` runs at each pass's first gradient (it lays out the parts for the world).
    """

    def __init__(self, params: List[List[torch.nn.Parameter]], grads: List[torch.Tensor], buckets: List[Bucket],
                 views: Callable[[torch.Tensor, List[torch.nn.Parameter]], List[torch.Tensor]],
                 send: Callable[[int], Any], attach: Callable[[], None], start: Callable[[], None],
                 passes_per_step: int) -> None:
        self.buckets, self.grads, self.send, self.attach, self.start = buckets, grads, send, attach, start
        self.passes_per_step = passes_per_step
        self.where: Dict[torch.nn.Parameter, Tuple[int, int, torch.Tensor]] = {}  # bucket, index, .grad view
        for g, (group, flat) in enumerate(zip(params, grads)):
            found = {i: b for b, bucket in enumerate(buckets) if bucket.group == g for i in bucket.params}
            for i, (p, view) in enumerate(zip(group, views(flat, group))):
                self.where[p] = (found[i], i, view)
        self.pending: Dict[int, Any] = {}  # bucket -> handle of its reducescatter
        self.ready: List[Set[int]] = [set() for _ in buckets]
        self.active = False  # more than one rank: there is something to send
        self.local = False  # inside no_sync()
        self.queued = self.final = False  # the pass now running: its end callback queued; it sends
        self.passes = 0  # backward passes since the last pass that sent
        self.versions: Optional[List[int]] = None  # the buffers' versions at the end of that pass
        self.late: Optional[torch.nn.Parameter] = None  # a gradient that came after its bucket was sent
        self.early = 0  # buckets the last sending pass sent from its hooks, before its end
        for p in self.where:
            p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, param: torch.nn.Parameter) -> None:
        if self.local:
            return
        if not self.queued:  # the pass's first gradient
            self.start()  # the world may have changed since the last pass
            if not self.active:
                return
            self.queued = True
            self.final = self.passes + 1 >= self.passes_per_step
            if self.final:
                self.drop()  # an earlier pass's reduction nobody took: its gradients are in the buffer still
                self.early = 0
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_pass)
        if not self.final:
            return
        b, i, view = self.where[param]
        grad = param.grad
        if grad is not None and (grad.is_sparse or grad.data_ptr() != view.data_ptr()):
            view.copy_(grad.to_dense() if grad.is_sparse else grad)  # a new .grad (after model.zero_grad())
            param.grad = view
        if b in self.pending:
            self.late = param
            return
        self.ready[b].add(i)
        if len(self.ready[b]) == len(self.buckets[b].params):
            self.pending[b] = self.send(b)
            self.early += 1

    def end_of_pass(self) -> None:
        self.queued = False
        if self.local:
            return
        self.passes += 1
        if not self.final:
            return
        self.passes = 0
        self.attach()
        for b in range(len(self.buckets)):
            if b not in self.pending:
                self.pending[b] = self.send(b)
        wake()  # everything is enqueued: Horovod's loop need not wait out its cycle
        self.versions = [g._version for g in self.grads]

    def sent(self) -> bool:
        """The last backward pass sent every bucket, and no pass came after it."""
        return self.active and self.passes == 0 and len(self.pending) == len(self.buckets) and bool(self.buckets)

    def check_unchanged(self, names: Dict[torch.nn.Parameter, str]) -> None:
        """Refuse a ``.grad`` changed after the backward pass that sent it (the change would not reach the step)."""
        if self.late is not None:
            late, self.late = self.late, None
            self.drop()
            raise RuntimeError(
                f"hvdp.DistributedOptimizer(shard_optimizer_state=True): {names.get(late, 'a parameter')} received "
                f"a gradient after its bucket was sent, twice in one backward pass (reentrant activation "
                f"checkpointing does this). Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        changed = [names.get(p, "a parameter") for p, (_, _, view) in self.where.items()
                   if p.grad is None or p.grad.data_ptr() != view.data_ptr()]
        if changed or self.versions != [g._version for g in self.grads]:
            self.drop()
            what = f"{changed[0]}.grad was replaced" if changed else "a .grad was changed in place"
            raise RuntimeError(
                f"hvdp.DistributedOptimizer(shard_optimizer_state=True): {what} after backward(), which had already "
                f"reduce-scattered the gradients, so the change would not reach the step. Fix: clip with "
                f"opt.clip_grad_norm_(max_norm) (it clips the reduced gradient by the whole model's norm), not "
                f"torch.nn.utils.clip_grad_norm_(model.parameters()); change the reduced gradients, which are "
                f"the .grad of opt.param_groups' parameters (this rank's part), rather than the model's.")

    def take(self) -> Dict[int, torch.Tensor]:
        """The reduced part of every bucket, waiting for the reducescatters."""
        order = sorted(self.pending)
        results = complete(*[self.pending[b] for b in order])
        self.clear()
        return dict(zip(order, results if len(order) > 1 else [results]))

    def drop(self) -> None:
        """Wait for the reducescatters in flight and forget them."""
        if self.pending:
            self.take()

    def clear(self) -> None:
        self.pending, self.versions = {}, None
        self.ready = [set() for _ in self.buckets]

    def reset(self) -> None:
        """Forget the passes (a new world: the handles of the old one are gone)."""
        self.clear()
        self.passes, self.queued, self.late = 0, False, None


def on_the_wire(view: torch.Tensor, compression: str) -> torch.Tensor:
    """``view`` as it is sent: float16 under ``compression="fp16"`` (floating point only), else itself."""
    return view.half() if compression == "fp16" and view.is_floating_point() else view


def send_bucket(flat: torch.Tensor, bucket: Bucket, compression: str, op: Any, prescale: float, postscale: float,
                process_set: Any, name: str) -> Any:
    """Start the reducescatter of ``bucket`` of the gradient buffer ``flat``; its handle."""
    return hvd.reducescatter_async(on_the_wire(flat[bucket.start:bucket.end], compression), name=name, op=op,
                                   prescale_factor=prescale, postscale_factor=postscale,
                                   process_set=process_set)

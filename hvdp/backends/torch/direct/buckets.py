"""The direct gradient path's buckets (:mod:`hvdp.backends.torch.direct.gradients`): how a learnt order of gradients is
cut (:func:`cut`), and one bucket's places and buffer (:class:`Bucket`)."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

from hvdp.backends.torch.buckets import Filler

#: Elements from which a gradient is allreduced in place, in its own ``.grad`` (1 MiB of float32): no copy
#: into a bucket and back, at the cost of one call of its own. Read when the plan is made (a test may lower it).
IN_PLACE = 1 << 18
#: Gathered buckets under this many bytes go two at a time: one right after another on lane 0 takes lane 1
#: (each lane a sender thread and a Gloo tag of its own). A small bucket's allreduce is mostly latency, and
#: two overlap (the MLP's two 1 MB buckets: steps of 8.1-8.7 ms against 9.0-10.3 with one lane, DDP 8.8-9.1,
#: three A/B runs). The others go one at a time, by lane 0: with ResNet-18's in-place buckets of 2.25 MB on
#: two lanes too its step took 199-208 ms against 191-199 with one lane.
TWO_LANES_BELOW = 2 << 20


class Bucket:
    """One bucket of the plan: its parameters, their places in its buffer, the buffer.

    An ``in_place`` bucket holds one large parameter and no buffer of its own: ``flat`` is that pass's
    ``.grad`` (flattened), set by the hook, and the allreduce writes the sum into the gradient itself.
    """

    def __init__(self, params: List[torch.nn.Parameter], extra: int, in_place: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        self.params, self.in_place = params, in_place
        self.lane = 0  # the sender thread that allreduces it (set by the plan)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.flat: Optional[torch.Tensor] = None if in_place else torch.zeros(
            self.offsets[-1] + extra, dtype=params[0].dtype if params else dtype)
        #: A gathered bucket's parameters' places, shaped like them (one copy in, one out, for all of them).
        self.shaped = [] if in_place else [self.view(i).view_as(p) for i, p in enumerate(params)]
        self.filled = [False] * len(params)
        self.count = 0
        self.done = threading.Event()
        self.errors: List[str] = []

    def whole(self) -> torch.Tensor:
        assert self.flat is not None  # a gathered bucket's buffer, or an in-place one's gradient once taken
        return self.flat

    def view(self, i: int) -> torch.Tensor:
        return self.whole()[self.offsets[i]:self.offsets[i + 1]]

    def take(self, param: torch.nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        """An in-place bucket's gradient for this pass (zeros when the pass gave it none)."""
        if grad is None:
            grad = param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif grad.is_sparse or not grad.is_contiguous():  # a flat view needs one dense, row-major tensor
            grad = param.grad = (grad.to_dense() if grad.is_sparse else grad).contiguous()
        self.flat = grad.view(-1)


def give_lanes(buckets: List[Bucket]) -> None:
    """Each bucket's sender lane: a small gathered bucket (:data:`TWO_LANES_BELOW`) right after a small one on
    lane 0 takes lane 1; every other bucket lane 0."""
    small = [not bucket.in_place and bucket.offsets[-1] * (bucket.params[0].element_size() if bucket.params else 4)
             < TWO_LANES_BELOW for bucket in buckets]
    for b, bucket in enumerate(buckets):
        bucket.lane = int(b > 0 and small[b] and small[b - 1] and buckets[b - 1].lane == 0)


def cut(order: List[torch.nn.Parameter], big: int) -> List[Tuple[List[torch.nn.Parameter], bool]]:
    """The buckets, in the order they fill when gradients come in ``order``: each parameter of ``big`` elements
    or more alone (in place), the others gathered per dtype by the planner of every bucketed path
    (:class:`hvdp.backends.torch.buckets.Filler`: the first bucket of a dtype about ``FIRST`` elements, the next
    about ``BUCKET``). The last bucket is always a gathered one (it carries the pass's counts;
    :meth:`.gradients.DirectGradients.finish`)."""
    buckets: List[Tuple[List[torch.nn.Parameter], bool]] = []
    fillers: Dict[torch.dtype, Filler[torch.nn.Parameter]] = {}  # one per dtype, in the order they first came
    for p in order:
        if p.numel() >= big:
            buckets.append(([p], True))
            continue
        filler = fillers.setdefault(p.dtype, Filler())
        if not filler.items:  # a bucket begins: the dtypes' last buckets are sent in the order they were begun
            fillers[p.dtype] = fillers.pop(p.dtype)
        full = filler.add(p, p.numel())
        if full is not None:
            buckets.append((full, False))
    buckets.extend((rest, False) for rest in (filler.rest() for filler in fillers.values()) if rest)
    if not buckets or buckets[-1][1]:
        buckets.append(([], False))  # the counts alone
    return buckets

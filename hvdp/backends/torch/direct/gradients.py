"""torch's steady-state gradient path: fixed buckets, each allreduced by a direct Gloo call as it fills.

Horovod's path runs every gradient through its background loop, whose every cycle starts
with a coordination round (which tensors are ready on every rank?) before the allreduce
itself. Once every rank has seen the same gradients in the same order, that round only
says what is known already. This path skips it:

1. **Learning.** The first step runs on Horovod's path while each rank records the order
   in which its gradients became ready. From that order each rank cuts fixed buckets
   (:func:`hvdp.backends.torch.direct.buckets.cut`: a gradient of ``IN_PLACE`` elements or
   more, 1 MiB of float32, alone, reduced in its own ``.grad``; the others gathered, the first
   bucket about 1 MiB, the next about 16 MiB), and the ranks compare their plans once, through
   Horovod (an allgather of the plan's digest). Equal plans everywhere switch every rank to
   the direct path at the same step; unequal ones keep Horovod's path (retried at most
   :data:`TRIES` times).
2. **Direct steps.** A full bucket (a large gradient, or a gathered bucket once its gradients are
   copied in), once all the buckets before it have gone, is handed to its lane's sender thread (two
   for small gathered buckets, :data:`.buckets.TWO_LANES_BELOW`), which allreduces it
   with ``horovod_hvdp_direct_allreduce`` (:data:`hvdp.horovod_build.patches.DIRECT_ALLREDUCE`) on
   Horovod's own Gloo context (a bucket of 512 KB or more, every rank on one machine: through shared
   memory, :mod:`.shm`), times the average's scale (every bucket but the last), while backward
   goes on. At the end of the backward pass the buckets not sent yet are sent, with zeros where a
   parameter got no gradient this pass (what Horovod's ``synchronize`` gives such a parameter), and
   the averages go into ``.grad``. Every rank sends every bucket, in the same order, with the same
   sizes, whatever its graph did. Meanwhile Horovod's background loop, with nothing to do, runs its
   rounds ``HVDP_QUIET_LOOP_MS`` (50) apart instead of every cycle
   (:func:`hvdp.backends.torch.direct.allreduce.quiet_loop`).
3. **A changed graph.** The last bucket carries one more element: the number of parameters
   this rank missed this pass. Its sum is the same on every rank, so every rank sees a change
   on any rank at the same step; the step's result is still right (zeros for the missing
   gradients, as on Horovod's path), and the next step learns again on Horovod's path.

A rank that stops sending (it stalled, or crashed) ends the others' wait after the stall
timeout (:func:`hvdp.backends.direct.timeout_ms`) as an :class:`hvdp.errors.StallError` (a ``HorovodInternalError``)
naming the bucket, with the stall report hvdp run reads, never a silent hang; a rank that left
its loop early serves the others' remaining steps with zeros (:func:`serve_until_finished`).
``HVDP_GRADIENT_PATH=horovod`` keeps Horovod's path throughout (to compare); the path taken
is on ``optimizer.gradient_path``. The direct calls themselves, the small ``hvdp.allreduce``
and Keras's gradients on the torch backend: :mod:`hvdp.backends.torch.direct.allreduce`.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import horovod.torch as hvd
import torch

from hvdp._state import job
from hvdp.backends.torch.direct import buckets
from hvdp.backends.torch.direct.allreduce import (
    PATH_ENV,
    DirectAllreduce,
    agreed,
    failure,
    quiet_loop,
    scale_if_direct,
    sender,
    usable_for,
)
from hvdp.backends.torch.direct.buckets import Bucket, cut
from hvdp.backends.torch.gradients import HorovodPath

#: Learning steps whose plans differed between ranks before the direct path is given up.
TRIES = 3


def serve_until_finished() -> None:
    """Before Horovod's join at the end of a job: a rank whose optimizer is on the direct path takes part
    in the other ranks' remaining steps with zeros (:meth:`DirectGradients.serve_until_finished`), as
    Horovod's join does on Horovod's path, so that ranks with more batches finish theirs (and the job
    then names each rank's step count). With two or more optimizers on it, the steps' buckets could not
    be told apart: the others then wait out the stall timeout and end with its message."""
    gc.collect()  # optimizers no longer reachable (an earlier run's) must not count
    on_it = [path for path in job().gradient_paths if path.mode == "direct"]
    if len(on_it) == 1:
        on_it[0].serve_until_finished()


def relearn_all() -> None:
    """After an elastic job's reset (hvdp.elastic): every direct path learns again on Horovod's path, so
    that the workers that survived and those that joined take the direct path together."""
    for path in list(job().gradient_paths):
        path.relearn()
    for group in list(job().groups):
        group.layout = group.tried = None


class DirectGradients:
    """The direct path of one Horovod torch optimizer (module docstring): a
    :class:`hvdp.backends.torch.gradients.GradientPath`, which learns (and falls back) on ``horovod``,
    Horovod's path of the same optimizer, through its methods.

    ``mode`` is ``learn`` (the next final pass runs on Horovod's path and records its order),
    ``direct`` or ``horovod`` (Horovod's path for good: the switch, or plans that never agreed).
    """

    name = "direct"

    def __init__(self, horovod: HorovodPath, names: Dict[torch.nn.Parameter, str], scale: Callable[[], float],
                 joining: Callable[[], bool]) -> None:
        self.horovod, self.names, self.scale, self.joining = horovod, names, scale, joining
        horovod.leads = False  # this path sets Horovod's loop quiet or not
        self.allreduce = DirectAllreduce(local=True, buckets=True)  # from 512 KB: through shared memory
        self.params = [p for group in horovod.optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.mode = "learn"
        self.tries = 0
        self.order: List[torch.nn.Parameter] = []  # the learning pass's gradients, in the order they came
        self.recorded: Set[torch.nn.Parameter] = set()
        self.buckets: List[Bucket] = []
        self.where: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        self.issued = 0  # buckets handed to the sender this pass
        self.step_scale = 1.0  # this pass's factor (the sender applies it to every bucket but the last)
        self.active = False  # the pass now running fills the buckets
        self.late: Optional[torch.nn.Parameter] = None
        self.world = hvd.size()
        #: Steps on each path, and the graph changes seen.
        self.counts = {"direct": 0, "horovod": 0, "changes": 0}
        self.final_pass: Callable[[], bool] = lambda: True
        self.pass_started: Callable[[], None] = lambda: None
        job().gradient_paths.add(self)  # serve_until_finished looks for those still on it

    # -- hooks -------------------------------------------------------------------------------

    def reduces(self) -> bool:
        return self.horovod.reduces()

    def watch(self, final_pass: Callable[[], bool], pass_started: Callable[[], None]) -> None:
        """Register the gradient hooks (Horovod's path's, for the learning steps, and this path's);
        ``final_pass()`` says whether the pass now running reduces."""
        self.horovod.watch(final_pass, pass_started)
        self.final_pass, self.pass_started = final_pass, pass_started
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.hook)

    def hold(self) -> None:
        self.horovod.hold()  # this path's hooks see that the pass is not final

    def release(self) -> None:
        self.horovod.release()

    def on_direct_path(self) -> bool:
        if self.mode == "direct" and hvd.size() != self.world:  # an elastic job's new world: learn it
            self.relearn()
        return self.mode == "direct" and not self.joining()

    def hook(self, param: torch.nn.Parameter) -> None:
        self.pass_started()  # this hook runs before the accumulator's own hooks: queue the end callback first
        if not self.active:  # the pass's first gradient (a direct pass, once started, checks nothing more)
            if not self.final_pass():
                return
            if self.mode == "learn":
                if param not in self.recorded:
                    self.order.append(param)
                    self.recorded.add(param)
                return
            if not self.on_direct_path():
                return
            self.start_pass()
        self.horovod.skip(param)  # before Horovod's hook (it runs after this one)
        b, i = self.where[param]
        bucket = self.buckets[b]
        if b < self.issued:
            self.late = param
            return
        grad = param.grad
        assert grad is not None  # this hook runs once it is accumulated
        if bucket.in_place:
            bucket.take(param, grad)
        elif grad.is_sparse:  # now; the dense ones are copied in together once the bucket is full
            bucket.shaped[i].copy_(grad.to_dense())
        if not bucket.filled[i]:
            bucket.filled[i] = True
            bucket.count += 1
        while self.issued < len(self.buckets) and self.buckets[self.issued].count == len(
                self.buckets[self.issued].params):
            self.send(self.issued)

    def start_pass(self) -> None:
        self.active, self.issued, self.late = True, 0, None
        self.step_scale = self.scale()
        quiet_loop(True)
        for bucket in self.buckets:
            bucket.filled = [False] * len(bucket.params)
            bucket.count = 0
            bucket.errors = []
            if bucket.in_place:
                bucket.flat = None
        self.buckets[-1].whole()[-2:] = 0

    def send(self, b: int) -> None:
        bucket = self.buckets[b]
        if not bucket.in_place:  # the gradients it got (dense: a sparse one is in already), in one call
            places, grads = [], []
            for place, p, filled in zip(bucket.shaped, bucket.params, bucket.filled):
                if filled and p.grad is not None and not p.grad.is_sparse:
                    places.append(place)
                    grads.append(p.grad)
            if places:
                torch._foreach_copy_(places, grads)
        bucket.done.clear()
        # Every bucket but the last comes back averaged (its sender applies the scale); the last carries the counts.
        scale = self.step_scale if b < len(self.buckets) - 1 else 1.0
        sender(self.allreduce, bucket.lane).jobs.put((bucket.whole(), scale, bucket.done, bucket.errors))
        self.issued = b + 1

    # -- the step ------------------------------------------------------------------------------

    def synchronize(self) -> Any:
        """The end of the step: the direct path's, or Horovod's when not on it (learning from it)."""
        if self.active:
            return self.finish()
        quiet_loop(False)
        result = self.horovod.synchronize()
        self.counts["horovod"] += 1
        if self.mode == "learn" and self.order:
            if self.joining():  # inside hvdp.join a rank may have joined: no allgather then; learn later
                self.order, self.recorded = [], set()
            else:
                self.learnt()
        return result

    def finish(self) -> Any:
        """Send what is left (zeros for the parameters without a gradient), wait, write the averages into ``.grad``."""
        missing = 0
        for bucket in self.buckets[self.issued:]:
            for i, filled in enumerate(bucket.filled):
                if not filled:
                    if bucket.in_place:  # zeros, as Horovod's path sends for a parameter without a gradient
                        grad = bucket.params[0].grad
                        bucket.take(bucket.params[0], grad.zero_() if grad is not None else None)
                    else:
                        bucket.view(i).zero_()
                    missing += 1
        if self.issued < len(self.buckets):
            self.buckets[-1].whole()[-2] = missing
            for b in range(self.issued, len(self.buckets)):
                self.send(b)
        self.active = False
        self.wait("gradients")
        changed, finished = (int(v) for v in self.buckets[-1].whole()[-2:].tolist())
        if self.step_scale != 1.0:  # the last bucket (always a gathered one) came back summed: it carries the counts
            self.buckets[-1].whole().mul_(self.step_scale)
        for bucket in self.buckets:
            if bucket.in_place:  # the average is in .grad already (the sender scaled it)
                bucket.flat = None
                continue
            # Copied out into each .grad, as Horovod's path leaves .grad: its own tensor (a view of the bucket
            # would save the copy, but a .grad kept from an earlier step would then change under its holder at
            # the next backward).
            grads = []
            for p, place in zip(bucket.params, bucket.shaped):
                if p.grad is None or p.grad.is_sparse:
                    p.grad = place.clone()
                grads.append(p.grad)
            torch._foreach_copy_(grads, bucket.shaped)
        self.horovod.forget()
        self.counts["direct"] += 1
        if self.late is not None:
            late, self.late = self.late, None
            raise RuntimeError(
                f"hvdp.DistributedOptimizer: {self.names.get(late, 'a parameter')} received a gradient after its "
                f"bucket was sent, twice in one backward pass (reentrant activation checkpointing does this). "
                f"Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        if changed:  # some rank's graph left parameters without a gradient
            self.counts["changes"] += 1
            if not finished:  # learn the order again (not while a finished rank serves the direct path only)
                self.relearn()
        return None

    def wait(self, what: str) -> None:
        """Wait for every bucket sent; a failed one ends the step with its reason (a timeout: who stalled)."""
        for bucket in self.buckets:
            bucket.done.wait()
        for b, bucket in enumerate(self.buckets):
            if bucket.errors:
                self.relearn()  # an elastic job goes on from its last commit: on Horovod's path first
                raise failure(
                    bucket.errors[0], f"hvdp's direct gradient allreduce of bucket {b + 1} of {len(self.buckets)} "
                    f"failed: {bucket.errors[0]}. Another rank stopped or stalled (see its output), or ran a "
                    f"different number of backward passes; {PATH_ENV}=horovod runs Horovod's path instead.",
                    f"hvdp.direct.{what}.bucket{b + 1}of{len(self.buckets)}")

    def serve_until_finished(self) -> None:
        """On a rank that left its training loop while on the direct path: send zeros for every bucket, as
        often as the ranks still training step, until every rank has left (each says so in the last
        bucket's last element). Horovod's join does this for Horovod's path."""
        if self.mode != "direct" or not self.buckets or hvd.size() != self.world:
            return
        zeros = {b: torch.zeros(bucket.offsets[-1], dtype=bucket.params[0].dtype)
                 for b, bucket in enumerate(self.buckets) if bucket.in_place}
        while True:
            self.start_pass()
            for b, bucket in enumerate(self.buckets):
                if bucket.in_place:
                    bucket.flat = zeros[b].zero_()
                else:
                    bucket.whole().zero_()
            self.buckets[-1].whole()[-1] = 1
            for b in range(len(self.buckets)):
                self.send(b)
            self.active = False
            self.wait("gradients (a rank that left its loop)")
            if int(self.buckets[-1].whole()[-1].item()) >= hvd.size():
                break
        self.mode = "horovod"  # the loop is over on every rank
        quiet_loop(False)  # Horovod's join next

    def relearn(self) -> None:
        self.mode, self.order, self.recorded = "learn", [], set()
        quiet_loop(False)
        self.horovod.restore()

    def learnt(self) -> None:
        """After a learning step on Horovod's path: cut the buckets, and take the direct path if every rank agrees."""
        order = self.order + [p for p in self.params if p not in self.recorded]
        self.order, self.recorded = [], set()
        usable = usable_for(self.allreduce, order)
        cuts = cut(order, buckets.IN_PLACE) if usable else []
        text = repr([([(self.index[p], tuple(p.shape), str(p.dtype)) for p in ours], in_place)
                     for ours, in_place in cuts])
        self.tries += 1
        if not agreed(text, usable, "hvdp.direct.plan"):
            if not usable or self.tries >= TRIES:
                self.mode = "horovod"
            return
        dtype = order[0].dtype if order else torch.float32
        self.buckets = [Bucket(ours, extra=2 if b == len(cuts) - 1 else 0, in_place=in_place, dtype=dtype)
                        for b, (ours, in_place) in enumerate(cuts)]
        buckets.give_lanes(self.buckets)
        self.where = {p: (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self.world, self.mode, self.tries = hvd.size(), "direct", 0


def direct_gradients(horovod: HorovodPath, named: Optional[List[Tuple[str, torch.nn.Parameter]]],
                     plan: Tuple[str, float, float], compression: str, groups: Any, process_set: Any,
                     sparse: bool, joining: Callable[[], bool]) -> Optional[DirectGradients]:
    """The direct path for ``optimizer``, or None where it does not apply (Horovod's path then, as before).

    It applies to averaged or summed dense CPU gradients of the whole job without compression or
    groups, when :data:`PATH_ENV` is not ``horovod``; the dtype and the controller (Gloo) are
    checked when the plan is made.
    """
    scale = scale_if_direct(plan, compression, groups, process_set)
    if scale is None or sparse:
        return None
    return DirectGradients(horovod, {p: n for n, p in named or []}, scale, joining)

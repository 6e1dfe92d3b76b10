"""torch's gradient path: gradients averaged when ``backward()`` returns, as under DDP.

Horovod's DistributedOptimizer starts each gradient's allreduce from a hook as
backward produces it, and waits for them in ``step()``. Everything a script puts
between ``backward()`` and ``step()`` (``clip_grad_norm_``, AMP's ``unscale_``,
gradient-norm logging) then sees this rank's own gradient, not the global one a DDP
user expects. :func:`reduce_at_backward_end` keeps Horovod's hooks (the overlap of
communication with the rest of backward) and adds one callback at the end of each
backward pass (autograd's ``queue_callback``, where DDP's reducer finishes too) that
waits for the allreduces and writes the averages into ``.grad``.

How a pass's gradients travel is a :class:`hvdp.backends.paths.GradientPath`, the one contract between the
optimizer wrapper and a path: :class:`HorovodPath` (Horovod's hooks, negotiation and
fusion buffer) or :class:`hvdp.backends.torch.direct.gradients.DirectGradients` (fixed
buckets by direct calls, learnt on Horovod's path). The wrapper speaks only to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import horovod.torch as hvd
import torch

from hvdp import profiler
from hvdp.backends.paths import GradientPath
from hvdp.backends.torch.direct.allreduce import quiet_loop

#: Longest sleep between two polls of an unfinished collective (seconds).
_POLL_MAX_SLEEP = 0.0005


def wait(handle: Any) -> None:
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


def _find_wake() -> Callable[[], None]:
    """The early wake of Horovod's background loop (:data:`hvdp.horovod_build.patches.EARLY_WAKE`).

    Called once everything a caller will wait for is enqueued (a step's gradients, a
    blocking collective): the loop starts its next round now instead of at the end
    of HOROVOD_CYCLE_TIME. A no-op with a build without it; ``HVDP_EARLY_WAKE=0`` is
    read by the build's C side, which then ignores the call.
    """
    found = getattr(hvd.mpi_ops._basics.MPI_LIB_CTYPES, "horovod_hvdp_wake_loop", None)
    if found is None:
        return lambda: None
    found.argtypes, found.restype = [], None
    return found


wake = _find_wake()


def complete(*handles: Any) -> Any:
    """The results of the collectives of ``handles``, enqueued by a caller that now blocks for them.

    Nothing else is coming from this caller: wake Horovod's loop, then wait with :func:`wait`.
    """
    wake()
    results = []
    for handle in handles:
        wait(handle)
        results.append(hvd.synchronize(handle))
    return results[0] if len(results) == 1 else results


#: A countdown Horovod's hooks never bring to zero: their allreduce is not started.
HELD = 1 << 40


class HorovodPath:
    """Horovod's own path (a :class:`hvdp.backends.paths.GradientPath`): its optimizer's hooks start each
    gradient's allreduce through its negotiation and fusion buffer; :meth:`synchronize` wakes its loop and
    waits for them, sleeping between polls (:func:`wait`). The only place that reaches into Horovod's
    optimizer (``_allreduce_delay``, ``_handles``, ``_grad_accs``); the direct path learns through it."""

    name = "horovod"

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._synchronize = optimizer.synchronize  # Horovod's, before the wrapper's
        self.mode = "horovod"
        self.counts = {"direct": 0, "horovod": 0, "changes": 0}
        #: The loop's usual rounds at each pass (set off by a path that keeps it quiet on its own steps).
        self.leads = True

    def reduces(self) -> bool:
        return bool(self.optimizer._grad_accs)

    def watch(self, final_pass: Callable[[], bool], pass_started: Callable[[], None]) -> None:
        def started(*_: Any) -> None:
            pass_started()
            if self.leads:  # this optimizer's gradients take Horovod's path: its loop's usual rounds
                quiet_loop(False)

        for accumulator in self.optimizer._grad_accs:
            accumulator.register_hook(started)

    def synchronize(self) -> Any:
        """Wake Horovod's loop (every gradient is enqueued by now: the wake saves the rest of the cycle the
        last ones would otherwise wait out), wait for the allreduces, then Horovod's ``synchronize``."""
        wake()
        for handle, _ in list(self.optimizer._handles.values()):
            if handle is not None and not callable(handle):
                wait(handle)
        result = self._synchronize()
        self.counts["horovod"] += 1
        return result

    def hold(self) -> None:
        delays = self.optimizer._allreduce_delay
        for parameter in delays:
            delays[parameter] += HELD

    def release(self) -> None:
        self.restore()
        for key in [key for key, (handle, _) in self.optimizer._handles.items() if handle is None]:
            del self.optimizer._handles[key]

    # -- for the direct path, which takes over some gradients and learns on this path --------------

    def skip(self, parameter: torch.nn.Parameter) -> None:
        """This pass, ``parameter``'s gradient goes another way: its Horovod hook (which runs after the
        caller's) does not start an allreduce."""
        self.optimizer._allreduce_delay[parameter] = HELD

    def restore(self) -> None:
        """Every gradient on this path again, from the next pass."""
        delays = self.optimizer._allreduce_delay
        for parameter in delays:
            delays[parameter] = self.optimizer.backward_passes_per_step

    def forget(self) -> None:
        """The pass's gradients were reduced another way: nothing of this path's is pending."""
        self.optimizer._handles.clear()


class _Passes:
    """Where one optimizer stands in its backward passes."""

    def __init__(self) -> None:
        self.passes = 0  # backward passes since the last reduction (no_sync passes not counted)
        self.queued = False  # the end-of-backward callback is queued for the pass now running
        self.reduced = False  # .grad holds averages: nothing to reduce until the next backward
        self.local = False  # inside no_sync()


def reduce_at_backward_end(optimizer: Any, path: GradientPath) -> Any:
    """Give Horovod's torch ``optimizer`` DDP's gradient semantics; returns it.

    - At the end of each backward pass that completes ``backward_passes_per_step``
      passes, the gradient allreduces are waited for and ``.grad`` holds the averages.
    - ``synchronize()`` and ``step()`` never reduce twice: after a reduction they
      only apply (Horovod's ``synchronize(); ...; with skip_synchronize(): step()``
      form works as before).
    - ``optimizer.no_sync()``: backward passes inside it accumulate locally; the first
      pass after it reduces the sum (DDP's ``no_sync``).

    The gradients travel by ``path`` (a :class:`~hvdp.backends.paths.GradientPath`), which gets its hooks
    here, told which passes reduce; it is on ``optimizer.gradient_path``. A one-process job (Horovod registers no
    hooks) is left as it is, with a ``no_sync`` that does nothing.
    """
    state = _Passes()
    synchronize, step, load_state_dict = profiler.timed(path.synchronize), optimizer.step, optimizer.load_state_dict

    def synchronize_once() -> Any:
        if state.reduced:
            return None
        result = synchronize()
        state.reduced, state.passes = True, 0
        return result

    def end_of_backward() -> None:
        state.queued = False
        if state.local:
            return
        state.passes += 1
        if state.passes >= optimizer.backward_passes_per_step:
            synchronize_once()

    def pass_started() -> None:
        if not state.queued:
            state.queued, state.reduced = True, False
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)

    def step_once(closure: Any = None) -> Any:
        if state.reduced and optimizer._should_synchronize:
            with optimizer.skip_synchronize():
                result = step(closure)
        else:  # fewer passes than backward_passes_per_step, or none: Horovod reduces what there is
            result = step(closure)
        state.reduced = True  # the update is applied: no reduction again until the next backward
        return result

    def load_state_dict_resetting(*args: Any, **kwargs: Any) -> Any:
        state.passes, state.queued, state.reduced = 0, False, False
        return load_state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        """Backward passes in this block accumulate ``.grad`` locally; the next one outside reduces the sum.

        Example:
            >>> with opt.no_sync():  # doctest: +SKIP
            ...     loss_fn(model(x0), y0).backward()  # local only
            >>> loss_fn(model(x1), y1).backward()  # doctest: +SKIP
            >>> opt.step()  # doctest: +SKIP
        """
        if state.local:
            raise RuntimeError("optimizer.no_sync() blocks do not nest; leave the open one first.")
        state.local = True
        path.hold()
        try:
            yield
        finally:
            state.local = False
            path.release()
            state.passes = 0

    optimizer.no_sync, optimizer.gradient_path = no_sync, path
    if not path.reduces():  # one process: nothing to reduce
        optimizer.synchronize = synchronize
        return optimizer
    optimizer.synchronize, optimizer.step = synchronize_once, step_once
    optimizer.load_state_dict = load_state_dict_resetting
    path.watch(lambda: not state.local and state.passes + 1 >= optimizer.backward_passes_per_step, pass_started)
    return optimizer


def broadcast_buffers_before_forward(model: torch.nn.Module, root_rank: int, process_set: Any,
                                     joining: Callable[[], bool] = lambda: False) -> None:
    """DDP's ``broadcast_buffers=True``: before each forward in training mode, ``root_rank``'s buffers.

    BatchNorm's running statistics are updated by each replica's forward from its own
    batch; without this they differ between replicas, and so does an evaluated or
    saved model. As under DDP, the forward then updates them from the local batch:
    a forward in training mode is a collective (every rank runs the same number).
    Inside ``hvdp.join`` (``joining()``), where ``root_rank`` may have run out of data,
    the buffers come from the lowest rank still stepping, by allreduce (a joined rank
    adds zeros). A model without buffers gets no hook.
    """
    buffers = [buffer for _, buffer in model.named_buffers() if buffer.numel() > 0]
    if not buffers:
        return
    # One broadcast per dtype, of all of its buffers end to end (as DDP coalesces them): resnet18's
    # 60 BatchNorm buffers one by one took 60 rounds of Horovod's loop per forward.
    by_dtype: dict = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    groups = sorted(by_dtype.items(), key=lambda item: str(item[0]))

    def from_lowest_stepping_rank(flats: list) -> None:
        me = hvd.rank()
        stepping = torch.zeros(hvd.size(), dtype=torch.int32)
        stepping[me] = 1
        stepping = complete(hvd.allreduce_async_(stepping, op=hvd.Sum, name="hvdp.join.stepping"))
        if int(stepping.nonzero()[0]) != me:
            for flat in flats:
                flat.zero_()
        complete(*[hvd.allreduce_async_(flat, op=hvd.Sum, name=f"hvdp.join.buffers.{dtype}")
                   for (dtype, _), flat in zip(groups, flats)])

    def before_forward(module: torch.nn.Module, _inputs: Any) -> None:
        if not module.training:
            return
        with torch.no_grad():
            flats = [torch.cat([buffer.reshape(-1) for buffer in group]) for _, group in groups]
            if joining():
                from_lowest_stepping_rank(flats)
            else:
                complete(*[hvd.broadcast_async_(flat, root_rank, name=f"hvdp.buffers.{dtype}",
                                                process_set=process_set)
                           for (dtype, _), flat in zip(groups, flats)])
            for (_, group), flat in zip(groups, flats):
                offset = 0
                for buffer in group:
                    buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()

    model.register_forward_pre_hook(before_forward)


def sparse_gradients(model: torch.nn.Module, as_dense: bool, groups: Any) -> None:
    """With ``as_dense``, the sparse embeddings' gradients are made dense as they arrive (Horovod's own
    sparse_as_dense misses grouped requests); grouped requests refuse sparse ones."""
    sparse = [m for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
              and getattr(m, "sparse", False)]
    if sparse and groups is not None and not as_dense:
        raise ValueError("hvdp.DistributedOptimizer(groups=...): the model has an embedding with sparse=True, and "
                         "Horovod's grouped requests take dense tensors only. Pass sparse_as_dense=True too, or "
                         "leave groups out.")
    def densify(param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.is_sparse:
            param.grad = param.grad.to_dense()

    if as_dense:
        for module in sparse:  # runs as the gradient lands in .grad, before Horovod's hook reads it
            module.weight.register_post_accumulate_grad_hook(densify)

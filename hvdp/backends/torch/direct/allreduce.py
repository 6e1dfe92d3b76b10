"""Direct calls on Horovod's own Gloo context, made by the calling thread without Horovod's rounds.

hvdp's Horovod build adds C entries (:data:`hvdp.horovod_build.direct_patches.DIRECT_ALLREDUCE`): a
sum-allreduce in place or from an input into an output (``horovod_hvdp_direct_allreduce_from``) and an
exchange of every rank's message with every rank (``horovod_hvdp_direct_exchange``), each call on a
Gloo tag of its own; under MPI, their peer with the same arguments (:mod:`hvdp.backends.direct_mpi`), which
:func:`controller_entry` returns there for the calls (the gradients keep Horovod's path under MPI). Here: their
Python side on torch, with its failures' one error (:func:`failure`; the stall timeout, the switch and the quiet
loop are every framework's: :mod:`hvdp.backends.direct`), the sender thread of torch's gradient path
(:mod:`.gradients`), and a Keras optimizer's gradients on the torch backend reduced together
(:class:`DirectGroup`). ``hvdp.allreduce``'s direct forms: :mod:`.calls`.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from hvdp._state import job
from hvdp.backends import direct, direct_mpi
from hvdp.backends.direct import CHANNELS, PATH_ENV, chosen_path, timeout_ms
from hvdp.backends.direct import is_quiet as is_quiet
from hvdp.backends.direct import quiet_ms as quiet_ms  # the torch side's names, as before
from hvdp.backends.direct import quiet_ms_from as quiet_ms_from
from hvdp.backends.torch.direct import shm
from hvdp.backends.torch.direct.shm import SharedMemory

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}
#: The direct allreduce's channels for a torch optimizer's gradients, one per sender thread (:func:`sender`;
#: each a Gloo tag of its own): two small buckets in a row go by lanes 0 and 1, both on the wire at once
#: (:data:`hvdp.backends.torch.direct.buckets.TWO_LANES_BELOW`).
GRADIENT_CHANNELS = (CHANNELS["torch gradient lane 0"], CHANNELS["torch gradient lane 1"])
#: The direct allreduce's channel for a Keras optimizer's gradients (:class:`DirectGroup`).
GROUP_CHANNEL = CHANNELS["torch keras group"]


def failure(error: Any, message: str, what: str) -> Exception:
    """:func:`hvdp.backends.direct.failure` for this torch job's rank and size: the error to raise for a direct
    call that failed with ``error`` (a :class:`hvdp.errors.StallError` on a timeout, after the stall report)."""
    return direct.failure(error, message, what, hvd.rank(), hvd.size())


def entry(name: str, *middle: Any) -> Any:
    """The build's C entry ``name`` in horovod.torch's library (:func:`hvdp.backends.direct.entry`)."""
    return direct.entry(hvd.mpi_ops._basics.MPI_LIB_CTYPES, name, *middle)


def controller() -> str:
    """The controller the direct calls run on in this job: ``gloo`` (the build's C entries on Horovod's Gloo
    context), ``mpi`` (their MPI peer, :mod:`hvdp.backends.direct_mpi`), or ``""`` where neither can (an MPI
    without full thread support, no mpi4py: said once by rank 0, and every call keeps Horovod's path). Fixed for
    the life of the process once Horovod is initialized."""
    state = job()
    if state.controller is not None:
        return state.controller
    if not hvd.is_initialized():
        return ""
    found = ""
    if hvd.gloo_enabled():
        found = "gloo"
    elif hvd.mpi_enabled():
        why = direct_mpi.reason()
        found = "" if why else "mpi"
        if why and hvd.rank() == 0 and hvd.size() > 1 and chosen_path() == "direct":
            print(f"hvdp: under MPI, hvdp.allreduce and the other collectives take Horovod's path: {why}. "
                  f"Fix: install it, or run on Gloo (hvdp run without --mpi).", file=sys.stderr, flush=True)
    state.controller = found
    return found


def controller_entry(name: str, *middle: Any) -> Any:
    """The direct entry ``name`` on this job's :func:`controller`: the build's C entry on Gloo (None in a build
    without it), its MPI peer on MPI, None otherwise. Same arguments and return codes on both."""
    kind = controller()
    if kind == "gloo":
        return entry(name, *middle)
    entries = direct_mpi.entries() if kind == "mpi" else None
    return None if entries is None else entries[name]


def exchange_entry() -> Any:
    """``horovod_hvdp_direct_exchange`` on this job's controller (:func:`controller_entry`): every rank's message
    to every rank (the small ``hvdp.allreduce`` calls' exchange, and the shared memory's headers and barriers)."""
    return controller_entry("horovod_hvdp_direct_exchange", ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int)


def local_memory() -> Optional[SharedMemory]:
    """The process's shared-memory allreduce (:mod:`.shm`), or None without an exchange on this controller."""
    made = job().local_memory
    if not made:
        exchange = exchange_entry()
        made.append(None if exchange is None else SharedMemory(exchange, timeout_ms))
    return made[0]


#: An entry not yet looked up (it is, at its first use after Horovod's init).
UNRESOLVED: Any = object()


class DirectAllreduce:
    """The build's ``horovod_hvdp_direct_allreduce_from``: the sum of every rank's ``tensor`` in place, or into
    ``into`` (Gloo's ring reading the tensor, writing the result), run by the calling thread."""

    def __init__(self, local: bool = False, buckets: bool = False) -> None:
        self._entry = UNRESOLVED  # resolved at the first use, after Horovod's init (:func:`controller_entry`)
        self.local = local  # through shared memory where every rank is on this machine (:mod:`.shm`)
        self.buckets = buckets  # from a gradient bucket's threshold there, instead of a call's

    @property
    def entry(self) -> Any:
        """``horovod_hvdp_direct_allreduce_from`` on this job's controller (:func:`controller_entry`)."""
        if self._entry is UNRESOLVED:
            if not hvd.is_initialized():
                return None
            self._entry = controller_entry("horovod_hvdp_direct_allreduce_from", ctypes.c_void_p, ctypes.c_longlong,
                                           ctypes.c_int, ctypes.c_int)
        return self._entry

    @entry.setter
    def entry(self, value: Any) -> None:
        self._entry = value

    def usable(self) -> bool:
        """For gradients: built in, and the job runs on Gloo (an MPI job's gradients keep Horovod's path; its
        ``hvdp.allreduce`` calls take the entry on MPI)."""
        return self.entry is not None and controller() == "gloo"

    def __call__(self, tensor: torch.Tensor, channel: int, into: Optional[torch.Tensor] = None,
                 scale: float = 1.0) -> None:
        """The sum times ``scale``: through shared memory in the same pass as the copy out of it; after Gloo's
        ring a pass of its own, by the calling thread (a sender's, while backward goes on)."""
        assert self.entry is not None, "usable() is checked before any call"
        local = local_memory() if self.local else None
        least = shm.BUCKET_MIN_BYTES if self.buckets else shm.SHM_MIN_BYTES
        if local is not None and local.serves(tensor, least):
            local(tensor, channel, into, lambda: self.ring(tensor, channel, into, scale), scale)
        else:
            self.ring(tensor, channel, into, scale)

    def ring(self, tensor: torch.Tensor, channel: int, into: Optional[torch.Tensor] = None,
             scale: float = 1.0) -> None:
        """Gloo's ring allreduce (the network stack, also between ranks of one machine), times ``scale``."""
        assert self.entry is not None
        out = tensor if into is None else into
        error = ctypes.create_string_buffer(1024)
        code = self.entry(tensor.data_ptr(), out.data_ptr(), tensor.numel(),
                          _DTYPES[tensor.dtype], channel, timeout_ms(), error, len(error))
        if code == 2:
            raise HorovodInternalError("hvdp's direct allreduce needs a Gloo or MPI job.")
        if code != 0:
            raise HorovodInternalError(error.value.decode(errors="replace"))
        if scale != 1.0:
            out.mul_(scale)


#: A sender's job: the flat tensor to sum in place, the factor to multiply the sum by, the event set when it is
#: done and the list its error goes into.
Job = Tuple[torch.Tensor, float, threading.Event, List[str]]


class _Sender(threading.Thread):
    """A thread that allreduces the buckets handed to it on its channel, in order (the GIL is free during each
    call).

    Two for the process (:func:`sender`), one per lane: a bucket goes by the lane its plan gives it, in
    the order the hooks hand them over, which is the same on every rank (two optimizers over one backward
    pass fill their buckets in autograd's order). Two small buckets in flight at once, as DDP's process
    group runs two Gloo threads; two threads on one channel could send its buckets in either order.
    """

    def __init__(self, allreduce: DirectAllreduce, channel: int) -> None:
        super().__init__(name=f"hvdp-direct-allreduce-{channel}", daemon=True)
        self.allreduce, self.channel = allreduce, channel
        self.jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()

    failed = False  # a call failed: the jobs queued behind it are not run (the step is lost anyway)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            flat, scale, done, errors = job
            try:
                if self.failed:
                    errors.append("not sent: an earlier bucket's allreduce failed")
                else:
                    self.allreduce(flat, self.channel, scale=scale)
            except Exception as error:  # handed to the waiting step, which raises it
                self.failed = True
                errors.append(str(error))
            finally:
                done.set()


def sender(allreduce: DirectAllreduce, lane: int = 0) -> _Sender:
    """The sender thread of ``lane``, started anew after a failed call (the jobs queued behind it were dropped)."""
    channel = GRADIENT_CHANNELS[lane % len(GRADIENT_CHANNELS)]
    senders = job().senders
    found = senders.get(channel)
    if found is None or not found.is_alive() or found.failed:
        found = senders[channel] = _Sender(allreduce, channel)
        found.start()
    return found


def usable_for(allreduce: "DirectAllreduce", tensors: Any) -> bool:
    """Whether ``allreduce`` can reduce ``tensors`` directly: a Gloo job, dense float32/float64 CPU tensors."""
    return allreduce.usable() and all(t.dtype in (torch.float32, torch.float64) and t.device.type == "cpu"
                                      for t in tensors)


def agreed(text: str, usable: bool, name: str) -> bool:
    """Whether every rank has the same ``text`` (a plan or layout, compared by digest) and can use it: one
    allgather through Horovod, so every rank reaches the same answer."""
    digest = zlib.crc32(text.encode())
    everyone = hvd.allgather(torch.tensor([[digest, int(usable)]], dtype=torch.int64), name=name)
    return bool((everyone[:, 0] == digest).all()) and bool(everyone[:, 1].all())


def quiet_loop(on: bool) -> None:
    """horovod.torch's background loop quiet or not (:func:`hvdp.backends.direct.quiet_loop`)."""
    direct.quiet_loop(hvd.mpi_ops._basics.MPI_LIB_CTYPES, on)


def scale_if_direct(plan: Tuple[str, float, float], compression: str, groups: Any,
                    process_set: Any) -> Optional[Callable[[], float]]:
    """The factor a direct path multiplies the sum by (read at each step: an elastic job's size changes), or
    None where no direct path applies: another op than average or sum, compression, groups, a process set,
    or :data:`PATH_ENV` set to ``horovod``. ``plan`` is :func:`hvdp.backends.base.reduction_plan`'s."""
    op, prescale, postscale = plan
    if chosen_path() != "direct" or op not in ("average", "sum") or compression != "none" or groups is not None:
        return None
    if process_set is not None and process_set != hvd.global_process_set:
        return None
    return lambda: 1.0 / hvd.size() if op == "average" else prescale * postscale


class DirectGroup:
    """One update's gradients reduced together (a Keras optimizer's, on Keras's torch backend), by direct calls.

    The first call, and the first after the gradients' dtypes or shapes change, runs on Horovod's
    path (``horovod_reduce``), and the ranks compare the layout once through Horovod; where every
    rank has the same, later calls put the gradients end to end in one kept buffer per dtype and
    allreduce each with one direct Gloo call (Keras gives every trainable variable a gradient, zeros
    where it has none, so the layout is the variables'). ``counts`` as :class:`DirectGradients`'.
    """

    def __init__(self, scale: Callable[[], float], joining: Callable[[], bool]) -> None:
        self.scale, self.joining = scale, joining
        self.allreduce = DirectAllreduce(local=True)  # its buffer from 8 MB: through shared memory
        self.layout: Optional[Tuple[Tuple[str, Tuple[int, ...]], ...]] = None  # agreed by every rank
        self.tried: Optional[Tuple[Tuple[str, Tuple[int, ...]], ...]] = None  # compared, not agreed
        self.buffers: Dict[torch.dtype, torch.Tensor] = {}
        self.world = hvd.size()
        self.counts = {"direct": 0, "horovod": 0, "changes": 0}
        job().groups.add(self)  # an elastic reset makes each learn again (gradients.relearn_all)

    def __call__(self, tensors: List[torch.Tensor], horovod_reduce: Callable[[List[Any]], List[Any]]) -> List[Any]:
        layout = tuple((str(t.dtype), tuple(t.shape)) for t in tensors)
        if layout == self.layout and not self.joining() and hvd.size() == self.world:
            return self.direct(tensors)
        quiet_loop(False)
        result = horovod_reduce(tensors)
        self.counts["horovod"] += 1
        if self.joining() or layout == self.tried:
            return result
        if self.layout is not None:
            self.counts["changes"] += 1
        if agreed(repr(layout), usable_for(self.allreduce, tensors), "hvdp.direct.layout"):
            self.layout, self.tried, self.world = layout, None, hvd.size()
            self.buffers = {}
            for t in tensors:
                self.buffers[t.dtype] = torch.empty(0)
            for dtype in self.buffers:
                self.buffers[dtype] = torch.empty(sum(t.numel() for t in tensors if t.dtype == dtype), dtype=dtype)
        else:
            self.layout, self.tried = None, layout
        return result

    def direct(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        quiet_loop(True)
        results: List[Any] = [None] * len(tensors)
        scale = self.scale()
        for dtype, flat in self.buffers.items():
            mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            offset = 0
            for i in mine:
                n = tensors[i].numel()
                flat[offset:offset + n].copy_(tensors[i].detach().reshape(-1))
                offset += n
            try:
                self.allreduce(flat, GROUP_CHANNEL, scale=scale)
            except HorovodInternalError as error:
                raise failure(
                    error, f"hvdp's direct gradient allreduce ({dtype}, {flat.numel()} elements) failed: {error}. "
                    f"Another rank stopped (see its output), or its model's trainable variables changed; "
                    f"{PATH_ENV}=horovod runs Horovod's path instead.", f"hvdp.direct.keras_gradients.{dtype}",
                ) from error
            offset = 0
            for i in mine:
                n = tensors[i].numel()
                results[i] = flat[offset:offset + n].view_as(tensors[i]).clone()
                offset += n
        self.counts["direct"] += 1
        return results


def direct_group(plan: Tuple[str, float, float], compression: str, groups: Any, process_set: Any,
                 joining: Callable[[], bool]) -> Optional[DirectGroup]:
    """The direct path of a Keras optimizer's gradients on the torch backend, or None (as :func:`direct_gradients`)."""
    scale = scale_if_direct(plan, compression, groups, process_set)
    return None if scale is None else DirectGroup(scale, joining)

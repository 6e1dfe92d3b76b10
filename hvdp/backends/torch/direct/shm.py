"""The direct allreduce between processes of one machine through shared memory, beside Gloo's ring.

Where every rank of a Gloo job runs on one machine (``hvd.local_size() == hvd.size()``), Gloo's ring
still sends every byte through the kernel's TCP loopback: each byte is copied into the kernel and out
again, on the same cores the model's compute runs on. Here each rank has, per channel, one file in
``/dev/shm`` mapped by every rank: a place for its tensor and one for its segment of the result.
``hvdp.allreduce``'s large calls (:mod:`.calls`) and torch's gradient buckets
(:mod:`.gradients`, from their sender thread) take it, from :data:`SHM_MIN_BYTES` and
:data:`BUCKET_MIN_BYTES`. Smaller ones keep Gloo's ring, one C call without the GIL.

1. Each rank copies its tensor into its place, all but its own segment (only the other ranks read a
   place); every rank's header (bytes, dtype, call count) goes to every rank by one direct exchange
   (``horovod_hvdp_direct_exchange``), which is also the barrier: all tensors are in. Headers that
   differ are refused on every rank, before any memory is read.
2. Rank ``r`` sums segment ``r`` of every rank's place (of its own tensor for itself), in rank order,
   into its result segment.
3. A second exchange (all segments summed), then each rank copies every result segment into its output,
   times the caller's scale in the same pass (the gradient path's average: no pass of its own).

Each rank reads and writes only its own segment in step 2, and a rank's next call on the channel writes
its places only after the next call's first exchange, so no lock is needed beyond the two exchanges.
With np=2 a call moves 4.5 times the tensor's bytes through memory on each rank (1 to copy in, 1.5 to
sum, 2 to copy out), where the ring's loopback copies it into the kernel and out again, on the cores
that compute, besides the protocol's own work.
The places grow with the largest tensor of the channel (all ranks at once: their headers agree); a rank
that cannot reserve the memory (a small ``/dev/shm``, e.g. a container's 64 MB) says so in the next
exchange and the channel keeps Gloo's ring from then on, on every rank. The files are unlinked as soon
as every rank has mapped them (``hvdp-*`` files stay only where a process is killed between the two).

At 64 MB on this machine (2 vCPUs, np=2) a call took 31 ms against Gloo's ring's 66 ms.
``HVDP_SHARED_MEMORY=0`` keeps Gloo's ring for everything (to compare).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
from typing import Any, Callable, Dict, List, Optional

import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.exceptions import HorovodInternalError

from hvdp._state import job

#: The environment variable that turns the shared-memory allreduce off (``0``) or on (``1``, the default).
SHM_ENV = "HVDP_SHARED_MEMORY"
#: The smallest ``hvdp.allreduce`` call (bytes) that goes through shared memory; smaller ones take Gloo's
#: ring. Below it, a call on its own, the two exchanges and the passes over memory cost as much as the ring
#: or more (np=2 here, medians of the quick bench: 1 MB 1.8-5.0 ms against the ring's 1.2-1.3; 4 MB 3.2-4.1
#: against 3.5-3.7; 16 MB 10.7-14.4 against 15.6-19.9).
SHM_MIN_BYTES = 8 << 20
#: The smallest gradient bucket (bytes) that goes through shared memory. Inside a training step it wins
#: from here: the ring's work in the kernel comes out of the cores backward runs on (np=2, 4 alternated
#: rounds, median steps: ResNet-18 161.4 ms against 172.3 from 8 MB, whose 1.2 to 4.7 MB gradients then
#: took the ring; the MLP's two 1 MB buckets 6.3 against 6.6; the CNN 71.2 against 72.6).
BUCKET_MIN_BYTES = 512 << 10
#: Where the files go (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
_MARK = 0x68766473  # "hvds"
_HEADER = 64  # bytes of a rank's place in the exchange's inbox
_ALIGN = 64  # bytes: segments start on cache lines
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}


def enabled_from(text: Optional[str]) -> bool:
    """:data:`SHM_ENV`'s value: on when unset or ``1``, off for ``0``; anything else is refused with the fix."""
    value = (text or "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{SHM_ENV}={text!r}: use 1 (the default: ranks on one machine reduce large tensors "
                         f"through shared memory) or 0 (Gloo's ring through the network stack).")
    return value == "1"


class _Channel:
    """One channel's shared memory: every rank's place (``places[r]``) and result segment (``results[r]``)."""

    def __init__(self) -> None:
        self.capacity = 0  # bytes of each rank's place
        self.places: List[torch.Tensor] = []  # uint8, one per rank
        self.results: List[torch.Tensor] = []
        self.maps: List[mmap.mmap] = []
        self.calls = 0
        self.files: List[str] = []  # every rank's file, unlinked once mapped
        self.ring_only = False  # the memory could not be had on some rank: Gloo's ring from now on


class SharedMemory:
    """The shared-memory allreduce of one process, for every channel (module docstring). ``exchange`` is the
    build's ``horovod_hvdp_direct_exchange`` (from :func:`hvdp.backends.torch.direct.allreduce.entry`)."""

    def __init__(self, exchange: Any, timeout_ms: Callable[[], int]) -> None:
        self.exchange_entry, self.timeout_ms = exchange, timeout_ms
        self.size, self.rank = hvd.size(), hvd.rank()
        self.on = (exchange is not None and enabled_from(os.environ.get(SHM_ENV)) and self.size >= 2
                   and hvd.local_size() == self.size and os.path.isdir(SHM_DIR))
        self.channels: Dict[int, _Channel] = {}
        self.inboxes: Dict[int, Any] = {}  # per channel: channels may be used by different threads at once
        self.errors: Dict[int, Any] = {}
        self.served = 0  # calls that went through shared memory (for tests and the bench)

    def serves(self, tensor: torch.Tensor, least: int) -> bool:
        """Whether ``tensor`` goes through shared memory, from ``least`` bytes (the same answer on every rank for
        the same call)."""
        if not self.on or tensor.dtype not in _DTYPES or tensor.numel() * tensor.element_size() < least:
            return False
        if self.size != hvd.size():  # an elastic job's new world: its own files
            self.size, self.rank, self.channels, self.inboxes = hvd.size(), hvd.rank(), {}, {}
            self.on = hvd.local_size() == self.size and self.size >= 2
        return self.on

    def headers(self, channel: int, values: List[int]) -> Any:
        """Every rank's ``values`` (int64) by one direct exchange on ``channel``: a barrier, too."""
        inbox = self.inboxes.get(channel)
        if inbox is None or inbox.shape[0] != self.size:
            inbox = self.inboxes[channel] = np.zeros((self.size, _HEADER // 8), dtype=np.int64)
        error = self.errors.get(channel)
        if error is None:
            error = self.errors[channel] = ctypes.create_string_buffer(1024)
        inbox[self.rank, :len(values)] = values
        code = self.exchange_entry(inbox.ctypes.data, _HEADER, 8 * len(values), channel, self.timeout_ms(),
                                   error, len(error))
        if code != 0:
            raise HorovodInternalError(error.value.decode(errors="replace") if code == 1 else
                                       "hvdp's shared-memory allreduce needs a Gloo job (this one runs on MPI).")
        return inbox[:, :len(values)]

    def __call__(self, tensor: torch.Tensor, channel: int, into: Optional[torch.Tensor],
                 ring: Callable[[], None], scale: float = 1.0) -> None:
        """The sum of every rank's ``tensor`` (contiguous) times ``scale`` into ``into`` (or in place); ``ring``
        runs the ring instead (Gloo's, or MPI's allreduce) where this channel's memory could not be had."""
        state = self.channels.setdefault(channel, _Channel())
        nbytes = tensor.numel() * tensor.element_size()
        state.calls += 1
        mine = [_MARK, nbytes, _DTYPES[tensor.dtype], state.calls, secrets.randbits(62) if self.rank == 0 else 0]
        grow = not state.ring_only and nbytes > state.capacity
        count = tensor.numel()
        per = _segment(count, tensor.element_size(), self.size)
        lo, hi = min(count, self.rank * per), min(count, (self.rank + 1) * per)
        flat = tensor.reshape(-1)
        if not grow and not state.ring_only:
            self.place(state, flat, lo, hi)
        everyone = self.headers(channel, mine)
        if not (everyone[:, :4] == everyone[self.rank, :4]).all():
            raise HorovodInternalError(
                f"Mismatched direct allreduce on channel {channel}: ranks passed tensors of different sizes or "
                f"dtypes, or a different number of calls (here: call {state.calls}, {tensor.dtype}, {nbytes} "
                f"bytes; every rank's bytes: {everyone[:, 1].tolist()}).")
        if grow:  # rank 0's token in the files' names: this job's files apart from another's
            self.grow(state, channel, nbytes, int(everyone[0, 4]))
            if not state.ring_only:
                self.place(state, flat, lo, hi)
                self.headers(channel, [_MARK, state.calls])  # every place written
        if state.ring_only:
            ring()
            return
        self.served += 1
        if hi > lo:  # this rank's own share straight from its tensor (it is in no place: nobody else reads it)
            views = [flat[lo:hi] if r == self.rank else place.view(tensor.dtype)[lo:hi]
                     for r, place in enumerate(state.places)]
            total = state.results[self.rank].view(tensor.dtype)[:hi - lo]
            torch.add(views[0], views[1], out=total)
            for view in views[2:]:
                total.add_(view)
        self.headers(channel, [_MARK, state.calls])  # every segment summed
        target = (tensor if into is None else into).view(-1)
        for r in range(self.size):
            a, b = min(count, r * per), min(count, (r + 1) * per)
            summed = state.results[r].view(tensor.dtype)[:b - a]
            if b > a and scale != 1.0:  # the scale in the same pass: Horovod's (a + b) * scale, alike on every rank
                torch.mul(summed, scale, out=target[a:b])
            elif b > a:
                target[a:b].copy_(summed)

    def place(self, state: _Channel, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat`` into this rank's place, all but its own segment ``lo:hi`` (only the other ranks read a place)."""
        mine = state.places[self.rank].view(flat.dtype)
        if lo > 0:
            mine[:lo].copy_(flat[:lo])
        if hi < flat.numel():
            mine[hi:flat.numel()].copy_(flat[hi:])

    def grow(self, state: _Channel, channel: int, nbytes: int, token: int) -> None:
        """Every rank's files for ``channel`` at a new size (all ranks at once): made, mapped by all, unlinked.
        A rank that cannot have the memory says so; then every rank keeps Gloo's ring on this channel."""
        capacity = -(-nbytes // (1 << 20)) * (1 << 20)  # whole MiB
        result_bytes = _segment(capacity, 1, self.size)
        total = capacity + result_bytes
        name = os.path.join(SHM_DIR, f"hvdp-{token:x}-c{channel}-{capacity >> 20}m-r{{}}")
        state.files = [name.format(r) for r in range(self.size)]
        ok, why = 1, ""
        try:
            fd = os.open(name.format(self.rank), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # the memory now, or an error (never a SIGBUS later)
            finally:
                os.close(fd)
        except OSError as error:
            ok, why = 0, error.strerror or str(error)
        everyone = self.headers(channel, [_MARK, ok])
        maps: List[mmap.mmap] = []
        try:
            if everyone[:, 1].all():
                for r in range(self.size):
                    fd = os.open(name.format(r), os.O_RDWR)
                    try:
                        maps.append(mmap.mmap(fd, total))
                    finally:
                        os.close(fd)
        except OSError:
            ok = 0
        finally:
            everyone = self.headers(channel, [_MARK, ok and len(maps) == self.size])  # every rank mapped them
            try:
                os.unlink(name.format(self.rank))
            except OSError:
                pass  # never made (this rank could not)
        if not everyone[:, 1].all():
            state.ring_only = True
            said_fallback(total, [r for r in range(self.size) if not everyone[r, 1]], why, self.rank)
            return
        state.maps = maps
        whole = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        state.places = [w[:capacity] for w in whole]
        state.results = [w[capacity:] for w in whole]
        state.capacity = capacity


def said_fallback(total: int, ranks: List[int], why: str, rank: int) -> None:
    """Once per process, on rank 0 (or on a rank that could not, where rank 0 could): that a channel falls back
    from shared memory to Gloo's ring, why, and the fix."""
    if job().shm_fallback_said or (rank != 0 and (rank not in ranks or 0 in ranks)):
        return
    job().shm_fallback_said = True
    print(f"hvdp: rank {', '.join(map(str, ranks))} could not reserve {total / (1 << 20):.0f} MiB of shared memory "
          f"in {SHM_DIR}{f' ({why})' if why else ''}: ranks on one machine reduce tensors of this size through "
          f"{'MPI' if hvd.mpi_enabled() and not hvd.gloo_enabled() else 'Gloo'}'s ring instead (same results, "
          f"slower). Fix: give {SHM_DIR} more room (a container: "
          f"--shm-size=1g, Compose: shm_size), or set {SHM_ENV}=0 to skip shared memory.", file=sys.stderr, flush=True)


def _segment(count: int, element_size: int, size: int) -> int:
    """Elements in each rank's segment of ``count``: a share, rounded up to whole cache lines."""
    per = -(-count // size)
    step = max(1, _ALIGN // element_size)
    return -(-per // step) * step

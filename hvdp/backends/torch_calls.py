"""``hvdp.allreduce`` of whole-job CPU tensors in a Gloo job, by direct calls on Horovod's own Gloo context
(:mod:`.torch_direct_calls`), without a round of Horovod's background loop.

- Up to :data:`CALL_MAX_BYTES`: one direct exchange (:class:`DirectExchange`). Every rank gets every
  rank's tensor and a header (name, dtype, shape, op), checks that they all agree, and sums them in
  rank order.
- Larger: the headers alone by one exchange (the same check), then Gloo's ring allreduce by the
  calling thread (``horovod_hvdp_direct_allreduce_from``), from the tensor straight into the result:
  a new tensor, or ``out=`` (Gloo copies the input in a segment at a time, overlapped with the ring's
  transfers; ``out`` the tensor itself: in place), as torch.distributed's Gloo allreduce does.

Both apply to sums and averages (floating point for an average) outside ``hvdp.join``, with
:data:`~.torch_direct_calls.PATH_ENV` not ``horovod``, in a Gloo job of 2 to :data:`CALL_MAX_RANKS`
processes; anything else takes Horovod's path, as before. A mismatch between ranks is refused on every
rank at once ("Mismatched", as Horovod says it, which :func:`hvdp.collectives.run` turns into a
TensorMismatchError naming each rank's tensor); a rank that never comes ends the call after the stall
timeout with Horovod's stall report.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from typing import Any, Dict, Optional, Tuple

import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.exceptions import HorovodInternalError

from hvdp.backends.torch_direct_calls import (
    DirectAllreduce,
    chosen_path,
    exchange_entry,
    quiet_loop,
    report_stall,
    timeout_ms,
)

#: The direct exchange's channel for ``hvdp.allreduce`` calls (the caller's thread).
CALL_CHANNEL = 2
#: The direct allreduce's channel for the larger ``hvdp.allreduce`` calls (the caller's thread).
LARGE_CHANNEL = 4
#: The largest tensor ``hvdp.allreduce`` reduces by one direct exchange (bytes); larger ones take the ring.
CALL_MAX_BYTES = 256 << 10
#: The most processes a direct exchange serves (each rank sends its message to every other one).
CALL_MAX_RANKS = 16
#: Bytes of the header before each rank's tensor: int64 marker, byte count, signature, and spare.
_HEADER = 64
_MARK = 0x68766470  # "hvdp"
_CALL_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64}
#: One direct call at a time in the process: a call's header exchange and its ring stay one pair.
_LOCK = threading.Lock()


class DirectExchange:
    """The build's ``horovod_hvdp_direct_exchange``: every rank's message to every rank, by the calling thread.

    Each rank's message (a header and its tensor's bytes) goes to every other rank into a place of
    :data:`CALL_MAX_BYTES` plus the header; a message may be shorter than its place, so ranks whose
    tensors differ in size get each other's headers and an error, where a collective on buffers of
    different sizes would end the process inside Gloo.
    """

    def __init__(self) -> None:
        self.entry = exchange_entry()
        self.inbox: Optional[torch.Tensor] = None  # every rank's place, kept from call to call
        # Its NumPy views: (ranks, capacity) bytes, and the headers' first (ranks, 3) int64.
        self.places: Any = np.empty((0, 0), dtype=np.uint8)
        self.headers: Any = np.empty((0, 3), dtype=np.int64)
        self.error = ctypes.create_string_buffer(1024)
        self.capacity = _HEADER + CALL_MAX_BYTES
        self.gloo: Optional[bool] = None

    def usable(self) -> bool:
        if self.gloo is None:  # the controller is fixed for the life of the process
            self.gloo = bool(hvd.gloo_enabled())
        return self.entry is not None and self.gloo

    def exchange(self, tensor: torch.Tensor, op: str, name: Optional[str], payload: Any = None) -> None:
        """Every rank's header for this call (and ``payload``, the tensor's values as NumPy, when given);
        raises on a rank whose header differs. Called under :data:`_LOCK`."""
        assert self.entry is not None, "usable() is checked before any call"
        size, rank = hvd.size(), hvd.rank()
        nbytes = tensor.numel() * tensor.element_size()
        mark = zlib.crc32(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{op}".encode())
        if self.inbox is None or self.inbox.numel() != size * self.capacity:
            self.inbox = torch.empty(size * self.capacity, dtype=torch.uint8)
            self.places = self.inbox.numpy().reshape(size, self.capacity)
            self.headers = self.places[:, :_HEADER].view(np.int64)[:, :3]
        self.headers[rank] = (_MARK, nbytes, mark)
        if payload is not None:
            self.places[rank, _HEADER:_HEADER + nbytes].view(payload.dtype)[:] = payload
        code = self.entry(self.inbox.data_ptr(), self.capacity, _HEADER + (0 if payload is None else nbytes),
                          CALL_CHANNEL, timeout_ms(), self.error, len(self.error))
        if code == 1 and b"imed out" in self.error.value:
            report_stall(f"{name or 'unnamed'}", timeout_ms())
        if code != 0:
            raise HorovodInternalError(self.error.value.decode(errors="replace") if code == 1 else
                                       "hvdp's direct exchange needs a Gloo job (this one runs on MPI).")
        if not (self.headers == self.headers[rank]).all():
            raise HorovodInternalError(  # "Mismatched", as Horovod says it: hvdp.collectives names each rank's
                f"Mismatched allreduce: ranks passed different names, dtypes, shapes or ops to the same call "
                f"of hvdp.allreduce ({name or 'unnamed'}: {tensor.dtype} {list(tensor.shape)}, {op} here).")

    def reduce(self, tensor: torch.Tensor, op: str, name: Optional[str]) -> torch.Tensor:
        """The sum (or average) of every rank's ``tensor``, summed in rank order: the same on every rank.

        NumPy views of the kept inbox do the packing and the sum: a small call's Python time adds to the
        exchange's on a busy machine (the other ranks' messages wait for this one's threads), and NumPy's
        calls on small arrays cost a few microseconds where torch's cost tens.
        """
        size = hvd.size()
        values = tensor.reshape(-1).numpy()
        with _LOCK:
            self.exchange(tensor, op, name, values)
            rows = self.places[:, _HEADER:_HEADER + values.nbytes].view(values.dtype)
            result = rows[0].copy()
            for r in range(1, size):
                result += rows[r]
        if op == "average":
            result /= size
        return torch.from_numpy(result).view(tensor.shape)


#: The most bytes of large results :class:`Results` keeps for reuse (the freed heap memory ``hvdp run``'s
#: allocator settings keep too, :data:`hvdp.launch.defaults.MALLOC_TRIM_THRESHOLD`).
RESULTS_MAX_BYTES = 256 << 20
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class Results:
    """The memory of large results, kept for the next call of the same size and dtype once its caller has
    let go of it: a fresh 64 MB tensor faults in 16384 pages (about 15 ms here, a quarter of the ring's
    time), a kept one none. The caller gets a view; the kept tensor is reused only when no view, NumPy
    array or other tensor shares its memory any more (its storage's use count), so a result still held is
    never written. At most :data:`RESULTS_MAX_BYTES`, the oldest let go first."""

    def __init__(self) -> None:
        self.kept: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = shape.numel()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if _USE_COUNT is None or nbytes > RESULTS_MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        key = (numel, dtype)
        base = self.kept.pop(key, None)
        if base is None or _USE_COUNT(base.untyped_storage()._cdata) > 2:  # 2: base's own and this call's
            base = torch.empty(numel, dtype=dtype)  # (the one still held is its holder's alone now)
        self.kept[key] = base  # the newest last
        while sum(t.numel() * t.element_size() for t in self.kept.values()) > RESULTS_MAX_BYTES:
            del self.kept[next(iter(self.kept))]
        return base.view(shape)


_EXCHANGE = DirectExchange()
_RING = DirectAllreduce(local=True)
_RESULTS = Results()


def direct_call(tensor: torch.Tensor, op: str, name: Optional[str], whole_job: bool, joining: bool,
                out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``hvdp.allreduce`` of ``tensor`` by direct calls (module docstring), into ``out`` when given; or None
    where they do not apply (the caller takes Horovod's path)."""
    size = hvd.size()
    if (op not in ("sum", "average") or not whole_job or joining or tensor.device.type != "cpu"
            or tensor.dtype not in _CALL_DTYPES or (op == "average" and not tensor.dtype.is_floating_point)
            or not 2 <= size <= CALL_MAX_RANKS or chosen_path() != "direct" or not _EXCHANGE.usable()):
        return None
    if tensor.numel() * tensor.element_size() <= CALL_MAX_BYTES:
        result = _EXCHANGE.reduce(tensor.detach(), op, name)
        if out is not None:
            out.copy_(result)
            return out
        return result
    if _RING.entry is None:
        return None  # out= was checked already (hvdp.collectives: kind, shape, dtype, contiguous memory)
    source = tensor.detach().contiguous()
    quiet_loop(True)  # Horovod's loop has nothing to do meanwhile (a tensor submitted to it wakes it)
    with _LOCK:
        target = out if out is not None else _RESULTS.take(tensor.shape, tensor.dtype)
        _EXCHANGE.exchange(source, op, name)  # the headers agree on every rank, or every rank raises
        try:
            _RING(source, LARGE_CHANNEL, into=target)
        except HorovodInternalError as error:
            if "imed out" in str(error):
                report_stall(f"{name or 'unnamed'}", timeout_ms())
            raise
    if op == "average":
        target.div_(size)
    return target

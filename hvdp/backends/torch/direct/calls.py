"""``hvdp.allreduce`` of whole-job CPU tensors by direct calls, without a round of Horovod's background loop: on
Horovod's own Gloo context in a Gloo job, on MPI's own communicator (duplicated) under ``hvdp run --mpi``
(:func:`~.allreduce.controller`, :mod:`hvdp.backends.direct_mpi`).

- Up to :data:`CALL_MAX_BYTES`: one direct exchange (:class:`DirectExchange`). Every rank gets every
  rank's tensor and a header (name, dtype, shape, op), checks that they all agree, and sums them in
  rank order.
- Larger: the headers alone by one exchange (the same check), then Gloo's ring allreduce (MPI's allreduce
  under MPI) by the calling thread (``horovod_hvdp_direct_allreduce_from``), from the tensor straight into
  the result (from 8 MB between ranks of one machine: through shared memory, :mod:`.shm`):
  a new tensor, or ``out=`` (Gloo copies the input in a segment at a time, overlapped with the ring's
  transfers; ``out`` the tensor itself: in place), as torch.distributed's Gloo allreduce does.

Both apply to sums and averages (floating point for an average) of tensors that need no gradient.

**Every call agrees first.** In a Gloo or MPI job of 2 to :data:`CALL_MAX_RANKS` processes with
:data:`~.allreduce.PATH_ENV` not ``horovod``, every whole-job collective outside ``hvdp.join``
(allreduce, allgather, broadcast, reducescatter, alltoall, grouped calls, the object collectives, barrier,
``broadcast_state``) starts with one header exchange: the call's kind, op, dtype, shape, root and name, and
whether this rank could take the direct path. The path is chosen from the agreed headers (direct where every
rank can, Horovod's otherwise), so two ranks never wait in two mechanisms; headers that differ are refused on
every rank at once (:class:`MismatchedCallsError`, which :func:`hvdp.collectives.run` turns into a
TensorMismatchError naming each rank's call), as Horovod's negotiation refuses them. A rank that has finished
its script says so in one last header (:func:`leave`), so a rank still calling is told at once. A rank that
never comes ends the call after the stall timeout with Horovod's stall report.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.exceptions import HorovodInternalError

from hvdp._state import job
from hvdp.backends.direct import CHANNELS
from hvdp.backends.torch.direct.allreduce import (
    UNRESOLVED,
    DirectAllreduce,
    chosen_path,
    exchange_entry,
    failure,
    quiet_loop,
    timeout_ms,
)
from hvdp.errors import TensorMismatchError, TrainingMismatchError

#: The direct exchange's channel for ``hvdp.allreduce`` calls (the caller's thread).
CALL_CHANNEL = CHANNELS["torch call exchange"]
#: The direct allreduce's channel for the larger ``hvdp.allreduce`` calls (the caller's thread).
LARGE_CHANNEL = CHANNELS["torch large call"]
#: The largest tensor ``hvdp.allreduce`` reduces by one direct exchange (bytes); larger ones take the ring.
CALL_MAX_BYTES = 256 << 10
#: The most processes a direct exchange serves (each rank sends its message to every other one).
CALL_MAX_RANKS = 16
#: Bytes of the header before each rank's tensor: int64 marker, byte count, the call's signature, whether this
#: rank can take the direct path, whether it has finished its script; from :data:`_TEXT_AT` the call's
#: description (UTF-8, cut to fit), for the error that names every rank's call.
_HEADER = 256
_TEXT_AT = 64
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
        self._entry: Any = UNRESOLVED  # resolved at the first use after Horovod's init (:attr:`entry`)
        self.inbox: Optional[torch.Tensor] = None  # every rank's place, kept from call to call
        # Its NumPy views: (ranks, capacity) bytes, and the headers' first (ranks, 5) int64.
        self.places: Any = np.empty((0, 0), dtype=np.uint8)
        self.headers: Any = np.empty((0, 5), dtype=np.int64)
        self.error = ctypes.create_string_buffer(1024)
        self.capacity = _HEADER + CALL_MAX_BYTES

    @property
    def entry(self) -> Any:
        """``horovod_hvdp_direct_exchange`` on this job's controller (:func:`~.allreduce.exchange_entry`: Gloo's
        C entry, or its MPI peer); None before Horovod's init."""
        if self._entry is UNRESOLVED:
            if not hvd.is_initialized():
                return None
            self._entry = exchange_entry()  # the controller is fixed for the life of the process
        return self._entry

    @entry.setter
    def entry(self, value: Any) -> None:
        self._entry = value

    def usable(self) -> bool:
        return self.entry is not None

    def agree(self, text: str, capable: bool, payload: Any = None, finished: bool = False) -> bool:
        """Every rank's header for this call (``text``, its description; and ``payload``, the tensor's values as
        NumPy, when given): whether every rank can take the direct path. Called under :data:`_LOCK`.

        Raises TensorMismatchError (:func:`refusal`) on every rank where the descriptions differ, and
        TrainingMismatchError where some ranks have finished their script (``finished``, :func:`leave`) and
        others still call.
        """
        assert self.entry is not None, "usable() is checked before any call"
        size, rank = hvd.size(), hvd.rank()
        nbytes = 0 if payload is None else payload.nbytes
        if self.inbox is None or self.inbox.numel() != size * self.capacity:
            self.inbox = torch.empty(size * self.capacity, dtype=torch.uint8)
            self.places = self.inbox.numpy().reshape(size, self.capacity)
            self.headers = self.places[:, :_TEXT_AT].view(np.int64)[:, :5]
        described = text.encode()
        self.headers[rank] = (_MARK, nbytes, zlib.crc32(described), int(capable), int(finished))
        described = described[:_HEADER - _TEXT_AT]
        self.places[rank, _TEXT_AT:_HEADER] = 0
        self.places[rank, _TEXT_AT:_TEXT_AT + len(described)] = np.frombuffer(described, dtype=np.uint8)
        if payload is not None:
            self.places[rank, _HEADER:_HEADER + nbytes].view(payload.dtype)[:] = payload
        code = self.entry(self.inbox.data_ptr(), self.capacity, _HEADER + nbytes, CALL_CHANNEL, timeout_ms(),
                          self.error, len(self.error))
        if code == 1:  # on a timeout, the stall report names the call's tensor
            raise failure(self.error.value, self.error.value.decode(errors="replace"),
                          text.partition(" | ")[0].rpartition(" named ")[2] or "unnamed")
        if code != 0:
            raise HorovodInternalError("hvdp's direct exchange needs a Gloo or MPI job.")
        done = self.headers[:, 4]
        if done.any():
            if done.all():
                return False
            self.left(done, text, finished)
        if not (self.headers[:, 2] == self.headers[rank, 2]).all():
            raise refusal([self.text(r) for r in range(size)])
        return bool(self.headers[:, 3].all())

    def text(self, rank: int) -> str:
        """The description of ``rank``'s call in the inbox."""
        return bytes(self.places[rank, _TEXT_AT:_HEADER]).rstrip(b"\0").decode(errors="replace")

    def left(self, done: Any, text: str, finished: bool) -> None:
        """Some ranks have finished their script (``done``), others still call: say so on both sides."""
        rank = hvd.rank()
        gone = ", ".join(str(r) for r in np.flatnonzero(done))
        calling = [r for r in range(len(done)) if not done[r]]
        if finished:
            raise TrainingMismatchError(
                f"rank {rank} finished its script while rank {', '.join(map(str, calling))} still called "
                f"hvdp.{said(self.text(calling[0]))}: {SAME_CALLS}")
        raise TrainingMismatchError(
            f"hvdp.{text.split(' ')[0]} on rank {rank} met a rank that has finished its script (rank {gone}; it "
            f"waits for the others at the job's end): {SAME_CALLS}")

    def reduce(self, tensor: torch.Tensor, op: str, text: str) -> Optional[torch.Tensor]:
        """The sum (or average) of every rank's ``tensor``, summed in rank order: the same on every rank; None
        where some rank cannot take the direct path (Horovod's path then, on every rank).

        NumPy views of the kept inbox do the packing and the sum: a small call's Python time adds to the
        exchange's on a busy machine (the other ranks' messages wait for this one's threads), and NumPy's
        calls on small arrays cost a few microseconds where torch's cost tens.
        """
        size = hvd.size()
        values = tensor.reshape(-1).numpy()
        with _LOCK:
            if not self.agree(text, True, values):
                return None
            rows = self.places[:, _HEADER:_HEADER + values.nbytes].view(values.dtype)
            result = rows[0].copy()
            for r in range(1, size):
                result += rows[r]
        if op == "average":
            result /= size
        return torch.from_numpy(result).view(tensor.shape)


def refusal(texts: List[str]) -> TensorMismatchError:
    """The error for calls that differ between ranks (``texts``: each rank's :func:`describe_call`), naming each."""
    calls, _, values = zip(*(text.partition(" | ") for text in texts))
    if len(set(calls)) == 1:
        return TensorMismatchError(
            f"hvdp.{calls[0]}: ranks passed different shapes or dtypes "
            f"({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}). Every rank must pass the same dtype "
            f"and shape (but the first dimension, in an allgather or alltoall) to the same collective.")
    return TensorMismatchError(
        f"ranks made different collective calls at the same point "
        f"({'; '.join(f'rank {r}: hvdp.{said(t)}' for r, t in enumerate(texts))}). Every rank must make the same "
        f"calls, in the same order, with the same kinds, names, ops, roots, dtypes and shapes.")


def said(text: str) -> str:
    """A header's description for a person: ``allreduce sum named loss of float32[2, 3]``."""
    call, _, values = text.partition(" | ")
    return f"{call} of {values}" if values else call


#: The fix, when ranks made different calls or some finished while others still call.
SAME_CALLS = ("every rank must make the same collective calls, in the same order (a model.fit, an evaluate or a "
              "metric on some ranks only leaves the others waiting).")


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


def exchanging(whole_job: bool, joining: bool) -> bool:
    """Whether a collective starts with the header exchange (module docstring): a whole-job call outside
    ``hvdp.join`` in a Gloo or MPI job of 2 to :data:`CALL_MAX_RANKS` processes on the direct path."""
    return (whole_job and not joining and 2 <= hvd.size() <= CALL_MAX_RANKS and chosen_path() == "direct"
            and _EXCHANGE.usable())


def describe_call(kind: str, values: Any = None, op: Optional[str] = None, root: Optional[int] = None,
                  name: Optional[str] = None) -> str:
    """A call as the header carries it, e.g. ``allreduce sum named loss | float32[2, 3]``: the call, then its
    values' dtypes and shapes (an allgather's or alltoall's first dimension is ``*``: it may differ)."""
    gathers = kind.endswith(("allgather", "alltoall"))  # (a grouped allgather is given an op it does not use)
    parts = [kind] + ([op] if op and not gathers else []) + ([f"from rank {root}"] if root is not None else [])
    described = []
    for value in values if isinstance(values, (list, tuple)) else [] if values is None else [values]:
        shape = [str(int(d)) for d in getattr(value, "shape", ())]
        dims = ["*", *shape[1:]] if gathers and shape else shape
        dtype = str(getattr(value, "dtype", type(value).__name__)).replace("torch.", "")
        device = getattr(getattr(value, "device", None), "type", "cpu")
        described.append(f"{dtype}[{', '.join(dims)}]" + ("" if device == "cpu" else f" on {device}"))
    return " ".join(parts + [f"named {name}" if name else "unnamed"]) + " | " + ", ".join(described)


def agree_call(whole_job: bool, joining: bool, kind: str, values: Any = None, op: Optional[str] = None,
               root: Optional[int] = None, name: Optional[str] = None) -> None:
    """The header exchange before a collective that takes Horovod's path (module docstring): returns once every
    rank makes the same call; raises on every rank where they differ."""
    if exchanging(whole_job, joining):
        job().calls_agreed = True
        with _LOCK:
            _EXCHANGE.agree(describe_call(kind, values, op, root, name), False)


def leave() -> None:
    """At the end of a job (before Horovod's join), where this process made header exchanges: one last header
    saying this rank has finished its script, so that a rank still calling is told at once (both raise
    TrainingMismatchError) instead of waiting out the stall timeout."""
    if job().calls_agreed and hvd.is_initialized() and exchanging(True, False):
        job().calls_agreed = False
        with _LOCK:
            _EXCHANGE.agree("finished | ", False, finished=True)


def direct_call(tensor: torch.Tensor, op: str, name: Optional[str], whole_job: bool, joining: bool,
                out: Optional[torch.Tensor] = None, grad: bool = False) -> Optional[torch.Tensor]:
    """``hvdp.allreduce`` of ``tensor`` by direct calls (module docstring), into ``out`` when given; or None
    where every rank takes Horovod's path (after the header exchange, where there is one). ``grad``: the
    tensor needs Horovod's autograd op."""
    if not exchanging(whole_job, joining):
        return None
    job().calls_agreed = True
    text = describe_call("allreduce", tensor, op, None, name)
    capable = (op in ("sum", "average") and tensor.device.type == "cpu" and tensor.dtype in _CALL_DTYPES
               and (op == "sum" or tensor.dtype.is_floating_point)
               and not grad)
    small = tensor.numel() * tensor.element_size() <= CALL_MAX_BYTES
    if not capable or (not small and _RING.entry is None):
        with _LOCK:
            _EXCHANGE.agree(text, False)
        return None
    if small:
        result = _EXCHANGE.reduce(tensor.detach(), op, text)
        if result is not None and out is not None:
            out.copy_(result)
            return out
        return result
    source = tensor.detach().contiguous()  # out= was checked already (hvdp.collectives: kind, shape, dtype, memory)
    quiet_loop(True)  # Horovod's loop has nothing to do meanwhile (a tensor submitted to it wakes it)
    with _LOCK:
        if not _EXCHANGE.agree(text, True):  # every rank raises here where the headers differ
            return None
        target = out if out is not None else _RESULTS.take(tensor.shape, tensor.dtype)
        try:
            _RING(source, LARGE_CHANNEL, into=target)
        except HorovodInternalError as error:
            raise failure(error, str(error), name or "unnamed") from error
    if op == "average":
        target.div_(hvd.size())
    return target


#: The torch backend's collectives (besides allreduce, :func:`direct_call`) that start with the header exchange.
AGREEING = ("allgather", "broadcast", "reducescatter", "alltoall", "grouped", "broadcast_object", "allgather_object",
            "barrier", "broadcast_state")


def agreeing(backend: Any) -> Any:
    """The torch backend's class, each collective of :data:`AGREEING` starting with :func:`agree_call`, with what
    its arguments say of the call (values, op, root, name; objects are not compared: they may differ)."""
    for kind in AGREEING:
        method = getattr(backend, kind)
        setattr(backend, kind, _agreeing(kind, method, inspect.signature(method)))
    return backend


def _agreeing(kind: str, method: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs).arguments
        agree_call(bound.get("process_set") is None, self.joining,
                   f"grouped {bound['kind']}" if kind == "grouped" else kind,
                   bound.get("values", bound.get("value")), bound.get("op"), bound.get("root_rank"), bound.get("name"))
        return method(self, *args, **kwargs)

    return call

"""The direct calls' MPI peer: the build's two Gloo entries (``horovod_hvdp_direct_exchange`` and
``horovod_hvdp_direct_allreduce_from``) made again with mpi4py on the job's own MPI, with the same arguments
and the same return codes, so that a job under ``hvdp run --mpi`` takes the same direct paths as a Gloo job
(the header exchange before every collective, small calls by one exchange, large ones through shared memory
or by one allreduce) and refuses the same mismatches.

- The exchange: one allgather of a fixed lead (each message's length and its first :data:`LEAD_BYTES`
  bytes: a header, a small call's values), then, only where some message is longer, one allgatherv of
  the rest. A rank whose message differs in length gets the others' headers, as on Gloo.
- The allreduce: ``MPI_Allreduce`` from the input into the output (in place where they are one), run by
  the calling thread after the call's header exchange has brought every rank to it.

Each channel (:data:`hvdp.backends.direct.CHANNELS`) has its own duplicate of the job's communicator, made
by every rank at Horovod's init (:func:`prepare`), so that calls of two threads never meet on one
communicator. The exchange waits by testing its request (spinning a little, then sleeping in short
naps), so it ends after the stall timeout as Gloo's does, with the words :func:`hvdp.backends.direct.timed_out`
knows. Needs mpi4py and an MPI that gives threads full use (``MPI_THREAD_MULTIPLE``: Horovod's background
thread uses MPI meanwhile); where either is missing, :func:`reason` says why and the calls keep Horovod's
path.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Dict, List, Optional

from hvdp._state import job
from hvdp.backends.direct import CHANNELS

#: The bytes of each message the exchange's first allgather carries (besides its length): a header and a small
#: call's values go in one round; a longer message's rest takes a second.
LEAD_BYTES = 4096 - 8
_MPI_TYPES = ("FLOAT", "DOUBLE", "INT32_T", "INT64_T")  # the entries' dtype codes 0..3
_LOCK = threading.Lock()


def _mpi() -> Any:
    """mpi4py's MPI module, without initializing or finalizing MPI itself (Horovod does both)."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI


def reason() -> str:
    """Why the MPI peer cannot run in this process (empty where it can): checked once, after Horovod's init."""
    state = job().mpi
    if "reason" not in state:
        try:
            mpi = _mpi()
        except ImportError:
            state["reason"] = "mpi4py is not installed (pip install 'hvdp[mpi]')"
            return str(state["reason"])
        if not mpi.Is_initialized() or mpi.Is_finalized():
            state["reason"] = "MPI is not initialized (not an MPI job)"
        elif mpi.Query_thread() != mpi.THREAD_MULTIPLE:
            state["reason"] = ("this MPI gives threads no full use (MPI_THREAD_MULTIPLE), which calls beside "
                               "Horovod's background thread need")
        else:
            state["reason"] = ""
    return str(state["reason"])


def prepare(comm: Any = None) -> None:
    """Every channel's duplicate of the job's communicator (``comm``, an mpi4py communicator given to
    ``hvdp.init``, else ``MPI_COMM_WORLD``), made in the channels' order by every rank at Horovod's init, where
    all ranks are together; a communicator of other ranks than Horovod's leaves the peer off (:func:`reason`)."""
    state = job().mpi
    if reason() or "comms" in state:
        return
    mpi = _mpi()
    base = comm if isinstance(comm, mpi.Comm) else mpi.COMM_WORLD if comm is None else None
    if base is None:
        state["reason"] = "hvdp.init was given its ranks as a list, not as an MPI communicator"
        return
    with _LOCK:
        state["comms"] = {number: base.Dup() for number in sorted(CHANNELS.values())}


def _comm(channel: int) -> Any:
    """The communicator of ``channel`` (:func:`prepare`)."""
    return job().mpi["comms"][channel]


def _wait(request: Any, timeout_ms: int) -> bool:
    """Whether ``request`` completed within ``timeout_ms``: tested in a spin for 200 us, then between naps that
    grow to 0.5 ms (a rank waiting leaves the cores to the others, as Gloo's waits do)."""
    if request.Test():
        return True
    start = time.perf_counter()
    deadline, nap = start + timeout_ms / 1000.0, 0.00005
    while not request.Test():
        now = time.perf_counter()
        if now - start > 0.0002:
            if now > deadline:
                return False
            time.sleep(nap)
            nap = min(nap * 2, 0.0005)
    return True


def _fail(error: Any, errlen: int, text: str) -> int:
    """``text`` into the caller's error buffer (a ctypes string buffer of ``errlen`` bytes); 1, as the C entries."""
    error.value = text.encode()[:max(0, errlen - 1)]
    return 1


def exchange(inbox: int, capacity: int, nbytes: int, channel: int, timeout_ms: int, error: Any,
             errlen: int) -> int:
    """``horovod_hvdp_direct_exchange`` on MPI: this rank's ``nbytes``-byte message, at its place in ``inbox``
    (``size`` places of ``capacity`` bytes, rank order), to every rank's place; 0 done, 1 failed (``error``)."""
    mpi = _mpi()
    comm = _comm(channel)
    size, rank = comm.Get_size(), comm.Get_rank()
    places = (ctypes.c_uint8 * (size * capacity)).from_address(inbox)
    lead = min(LEAD_BYTES, capacity)
    key = ("leads", channel, size, lead)
    state = job().mpi
    leads = state.get(key)
    if leads is None:
        leads = state[key] = (ctypes.c_uint8 * (size * (lead + 8)))()
    mine = rank * (lead + 8)
    ctypes.c_int64.from_buffer(leads, mine).value = nbytes
    ctypes.memmove(ctypes.addressof(leads) + mine + 8, inbox + rank * capacity, min(nbytes, lead))
    try:
        request = comm.Iallgather(mpi.IN_PLACE, [leads, mpi.BYTE])
        if not _wait(request, timeout_ms):
            return _fail(error, errlen, f"Timed out waiting {timeout_ms}ms for the other ranks' messages "
                                        f"(MPI exchange on channel {channel})")
        counts: List[int] = []
        for r in range(size):
            at = r * (lead + 8)
            count = ctypes.c_int64.from_buffer(leads, at).value
            counts.append(count)
            if r != rank:
                ctypes.memmove(inbox + r * capacity, ctypes.addressof(leads) + at + 8, min(count, lead, capacity))
        rest = [max(0, min(count, capacity) - lead) for count in counts]
        if any(rest):
            displacements = [r * capacity + lead for r in range(size)]
            request = comm.Iallgatherv(mpi.IN_PLACE, [places, rest, displacements, mpi.BYTE])
            if not _wait(request, timeout_ms):
                return _fail(error, errlen, f"Timed out waiting {timeout_ms}ms for the other ranks' messages "
                                            f"(MPI exchange on channel {channel})")
    except mpi.Exception as failed:
        return _fail(error, errlen, f"MPI exchange on channel {channel} failed: {failed}")
    return 0


def allreduce_from(source: int, target: int, count: int, dtype: int, channel: int, timeout_ms: int, error: Any,
                   errlen: int) -> int:
    """``horovod_hvdp_direct_allreduce_from`` on MPI: the sum of every rank's ``count`` elements at ``source``
    into ``target`` (in place where they are one); 0 done, 1 failed (``error``). Called once the call's header
    exchange brought every rank to it, so it waits as MPI's own allreduce does."""
    mpi = _mpi()
    comm = _comm(channel)
    kind = getattr(mpi, _MPI_TYPES[dtype])
    nbytes = count * kind.Get_size()
    into = mpi.buffer.fromaddress(target, nbytes)
    try:
        if source == target:
            comm.Allreduce(mpi.IN_PLACE, [into, count, kind], op=mpi.SUM)
        else:
            comm.Allreduce([mpi.buffer.fromaddress(source, nbytes, readonly=True), count, kind],
                           [into, count, kind], op=mpi.SUM)
    except mpi.Exception as failed:
        return _fail(error, errlen, f"MPI allreduce on channel {channel} failed: {failed}")
    return 0


def entries() -> Optional[Dict[str, Any]]:
    """The two entries by the build's names, or None where :func:`reason` says the peer cannot run (or
    :func:`prepare` did not)."""
    if reason() or "comms" not in job().mpi:
        return None
    return {"horovod_hvdp_direct_exchange": exchange, "horovod_hvdp_direct_allreduce_from": allreduce_from}

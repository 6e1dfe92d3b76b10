"""What every framework's direct path shares, without importing a framework: the switch between the direct
path and Horovod's (:data:`PATH_ENV`), how long a direct call waits (:func:`timeout_ms`), its one error on a
failure (:func:`failure`: a ``DirectStallError`` with the stall report, :func:`report_stall`, when it timed
out, :func:`timed_out`), every framework's Gloo channels (:data:`CHANNELS`), the build's C entries
(:func:`entry`) and the quiet loop (:func:`quiet_loop`). torch's direct path: :mod:`.torch.direct` (a package);
TensorFlow's: :mod:`.tensorflow.direct` (one module).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Dict, Optional, Union

from hvdp._state import job
from hvdp.errors import StallError

#: The environment variable that picks the gradient path: ``direct`` (the default) or ``horovod``.
PATH_ENV = "HVDP_GRADIENT_PATH"


def chosen_path() -> str:
    """``direct`` or ``horovod``, from :data:`PATH_ENV`; anything else is refused with the choices."""
    value = os.environ.get(PATH_ENV, "direct").strip().lower() or "direct"
    if value not in ("direct", "horovod"):
        raise ValueError(f"{PATH_ENV}={value!r}: use 'direct' (the default: buckets allreduced without Horovod's "
                         f"per-cycle coordination round once the ranks agree) or 'horovod' (Horovod's path).")
    return value


#: The stall timeout when none is set (hvdp run's default, ``--stall-timeout``): how long a direct call waits.
DEFAULT_TIMEOUT_S = 300

#: Every direct call's Gloo channel, both frameworks' in one table: each is a Gloo tag of its own, so two
#: calls that can be on the wire at once never share one. The modules take theirs from here by name.
CHANNELS: Dict[str, int] = {
    "torch gradient lane 0": 1,  # torch's gradient buckets, one sender thread per lane (torch.direct.allreduce)
    "torch call exchange": 2,  # hvdp.allreduce's small calls and every call's header (torch.direct.calls)
    "torch keras group": 3,  # a Keras optimizer's gradients on torch (torch.direct.allreduce.DirectGroup)
    "torch large call": 4,  # hvdp.allreduce's larger calls by Gloo's ring (torch.direct.calls)
    "torch gradient lane 1": 5,
    "tensorflow gradients": 6,  # the HvdpDirectAllreduce op (tensorflow.direct)
    "tensorflow layout": 7,  # the layout exchange before it (tensorflow.direct)
}


def stall_timeout_s() -> int:
    """The job's stall timeout in seconds (hvdp run sets ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` from
    ``--stall-timeout``); 0 where none is set."""
    try:
        return max(0, int(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0")))
    except ValueError:
        return 0


def timeout_ms() -> int:
    """How long a direct call waits for the other ranks: the job's stall timeout (:func:`stall_timeout_s`),
    else :data:`DEFAULT_TIMEOUT_S`.

    Horovod's path waits as long before its stall inspector ends the job: a rank that is merely busy
    (rank 0 evaluating or saving while the others wait) is given the same time on both paths.
    """
    return 1000 * (stall_timeout_s() or DEFAULT_TIMEOUT_S)


def timed_out(error: Union[str, bytes, BaseException]) -> bool:
    """Whether a direct call's ``error`` (its text, or the exception) says it waited past :func:`timeout_ms`:
    Gloo's "Timed out ..." or "... timeout ...", the same test as the TensorFlow op's in the build.

    >>> timed_out("Timed out waiting 300000ms for recv operation to complete"), timed_out(b"Connection reset")
    (True, False)
    """
    text = error.decode(errors="replace") if isinstance(error, bytes) else str(error)
    return "imed out" in text or "timeout" in text


@functools.lru_cache(maxsize=None)
def stall_error() -> type:
    """``DirectStallError``, the one error of a direct call that timed out (:func:`failure`): an
    :class:`hvdp.errors.StallError` that Horovod's elastic loop treats as its own failure
    (``HorovodInternalError``). Made on first use, so that this module imports no Horovod (the tools import it)."""
    from horovod.common.exceptions import HorovodInternalError

    return type("DirectStallError", (StallError, HorovodInternalError), {"__module__": __name__, "__doc__": (
        "A direct call waited past the stall timeout (hvdp.StallError, and Horovod's HorovodInternalError).")})


def __getattr__(name: str) -> Any:
    """``direct.DirectStallError`` (:func:`stall_error`), importable by name once Horovod is wanted."""
    if name == "DirectStallError":
        return stall_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def failure(error: Union[str, bytes, BaseException], message: str, what: str, rank: int, size: int) -> Exception:
    """The exception for a direct call that failed with ``error``, carrying ``message``: a ``DirectStallError``
    (:func:`stall_error`) after the stall report naming ``what`` (:func:`report_stall`) when it waited past
    :func:`timeout_ms`, else Horovod's ``HorovodInternalError``. Every direct module raises what this returns."""
    if timed_out(error):
        report_stall(what, timeout_ms(), rank, size)
        return stall_error()(message)
    from horovod.common.exceptions import HorovodInternalError

    return HorovodInternalError(message)


def report_stall(what: str, waited_ms: int, rank: int, size: int) -> None:
    """On a timed-out direct call: the lines of Horovod's stall report that hvdp run reads (every other rank
    never sent ``what``), so the job ends saying which rank stalled, as on Horovod's path."""
    lines = [f"[hvdp] One or more ranks stalled for {waited_ms // 1000} s in a direct allreduce ({what}). "
             f"Missing ranks:"] + [f"{r}!: [allreduce.{what}]" for r in range(size) if r != rank]
    print("\n".join(lines), file=sys.stderr, flush=True)


def entry(library: Any, name: str, *middle: Any) -> Any:
    """The C entry ``name`` of a framework's Horovod ``library`` (ctypes; None in a build without it): a pointer,
    ``middle``, then the timeout in ms, the error buffer and its size, returning an int (0 done, 1 failed,
    2 not a Gloo job)."""
    found = getattr(library, name, None)
    if found is not None:
        found.argtypes = [ctypes.c_void_p, *middle, ctypes.c_longlong, ctypes.c_char_p, ctypes.c_int]
        found.restype = ctypes.c_int
    return found


#: How far apart (ms) Horovod's background loop runs its rounds while the process's gradients take the
#: direct path (:data:`hvdp.horovod_build.direct_patches.QUIET_LOOP`; a submitted tensor wakes it sooner):
#: 50 unless ``HVDP_QUIET_LOOP_MS`` says otherwise (0 turns it off). At 50 ResNet-18's step is 2.6% shorter.
#: Read when the loop is first spaced out, after ``hvdp.init`` checked it (:mod:`hvdp.environment`), never at import.
QUIET_ENV = "HVDP_QUIET_LOOP_MS"


def quiet_ms_from(text: Optional[str]) -> int:
    """:data:`QUIET_ENV`'s value in ms (50 when unset or empty); anything else is refused with the fix."""
    value = (text or "").strip() or "50"
    if not value.isdigit() or int(value) > 10_000:
        raise ValueError(f"{QUIET_ENV}={text!r} is not a number of milliseconds from 0 to 10000: set e.g. 50 "
                         f"(the default), or 0 to keep Horovod's loop at its cycle time.")
    return int(value)


def quiet_ms() -> int:
    """:data:`QUIET_ENV`'s value now (the job's: ``hvdp.init`` refused a bad one before any loop ran)."""
    return quiet_ms_from(os.environ.get(QUIET_ENV))


def quiet_loop(library: Any, on: bool) -> None:
    """Space the background rounds of ``library``'s Horovod :func:`quiet_ms` apart (``on``: the gradients go
    direct, the loop has nothing to do) or back to the cycle time. Cheap when unchanged; a no-op with a build
    without it, or while :func:`quiet_ms` is 0 or not longer than the job's HOROVOD_CYCLE_TIME (never rounds
    more often)."""
    state = job()
    if state.quiet_loop == on:
        return
    spacing = quiet_ms()
    on = on and spacing > float(os.environ.get("HOROVOD_CYCLE_TIME", "0") or 0)
    if state.quiet_loop == on:
        return
    state.quiet_loop = on
    found = getattr(library, "horovod_hvdp_quiet_loop", None)
    if found is not None:
        found.argtypes, found.restype = [ctypes.c_int], None
        found(spacing if on else 0)


def is_quiet() -> bool:
    """Whether :func:`quiet_loop` spaced the rounds out (for tests and the bench)."""
    return job().quiet_loop

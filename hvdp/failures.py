"""Failure records: each rank writes down its own uncaught exception, and ``hvdp run`` reads it.

``hvdp.init()`` calls :func:`install`. When the rank runs under ``hvdp run`` (its worker
bootstrap sets :data:`FILE_VAR`), an uncaught exception is written as one JSON record
(:class:`Failure`: rank, host, type, message, traceback, time) to that file before the
interpreter exits; the bootstrap sends it to ``hvdp run``, which names the first failure
of the job as its cause and prints that traceback once (torchrun's ``@record`` and error
files work the same way). Outside ``hvdp run`` nothing changes: the exception is printed
as usual.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Dict, Iterator, Optional, Type

#: The file a rank writes its failure record to (set for each rank by ``hvdp run``).
FILE_VAR = "HVDP_FAILURE_FILE"

#: Exceptions that only say another rank failed first (Horovod stops the collectives of every rank).
CONSEQUENCES = ("Horovod has been shut down", "HorovodInternalError")


@dataclass
class Failure:
    """One rank's uncaught exception."""

    rank: int
    host: str
    type: str
    message: str
    traceback: str
    time: float

    @property
    def consequence(self) -> bool:
        """Whether this exception is only another rank's failure reaching this one."""
        return any(text in self.type or text in self.message for text in CONSEQUENCES)

    def describe(self) -> str:
        """``raised RuntimeError: injected failure at step 5``."""
        return f"raised {self.type}: {self.message}" if self.message else f"raised {self.type}"

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Failure":
        """A record read back (fields it lacks get neutral values)."""
        return cls(rank=int(data.get("rank", -1)), host=str(data.get("host", "")), type=str(data.get("type", "")),
                   message=str(data.get("message", "")), traceback=str(data.get("traceback", "")),
                   time=float(data.get("time", 0.0)))


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return -1


def record(exc_type: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> Failure:
    """The record of an exception raised on this rank.

    Example:
        >>> try:
        ...     raise ValueError("bad")
        ... except ValueError as exc:
        ...     failure = record(type(exc), exc, exc.__traceback__)
        >>> failure.describe(), failure.traceback.splitlines()[-1]
        ('raised ValueError: bad', 'ValueError: bad')
    """
    return Failure(rank=_rank(), host=socket.gethostname(), type=exc_type.__name__, message=str(value),
                   traceback="".join(traceback.format_exception(exc_type, value, tb)), time=time.time())


def write(value: BaseException) -> bool:
    """Write ``value`` as this rank's failure record for ``hvdp run``; False where none can be written (outside
    ``hvdp run``, or the file cannot be opened). Also for an error raised at exit, where no hook runs."""
    path = os.environ.get(FILE_VAR)
    if not path:
        return False
    try:
        with open(path, "w") as out:
            json.dump(asdict(record(type(value), value, value.__traceback__)), out)
    except OSError:
        return False
    return True


def install() -> None:
    """Record this rank's uncaught exception for ``hvdp run`` (only when it set :data:`FILE_VAR`).

    The exception is then not printed here: ``hvdp run`` prints the traceback of the first
    failure once, and keeps every rank's in its ``--log-dir`` files. Idempotent.
    """
    path = os.environ.get(FILE_VAR)
    if not path or getattr(sys.excepthook, "_hvdp_failure_hook", False):
        return
    previous = sys.excepthook

    def hook(exc_type: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or not write(value):
            previous(exc_type, value, tb)  # no record: print it as usual

    hook._hvdp_failure_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


@contextmanager
def ended_if_stuck(what: str, why: str, stall: float, slack: float = 0.0) -> Iterator[None]:
    """Run the block; if it has not returned within ``stall`` seconds (the job's stall timeout; none where it is
    0, or in an elastic job, whose workers wait for each other by design) plus ``slack`` seconds, end this
    process with a failure record (or, outside ``hvdp run``, a line on stderr) saying that ``what`` did not
    finish and ``why``, so that the job ends naming this rank instead of waiting for ever. For a block stuck in
    C, where no exception can reach it (``MPI_Init`` in Horovod's background thread)."""
    if stall <= 0 or os.environ.get("HOROVOD_ELASTIC") == "1":
        yield
        return
    seconds = stall + slack
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        from hvdp.errors import StallError

        allowed = f"the stall timeout, {stall:g} s (hvdp run --stall-timeout)" + (
            f", and {slack:g} s for the ranks' start" if slack else "")
        error = StallError(f"{what} did not finish in {seconds:g} s ({allowed}). {why} This rank ends so that the "
                           f"job does not wait for ever")
        if not write(error):
            print(f"hvdp: rank {_rank()}: {error}", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="hvdp-stuck-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()

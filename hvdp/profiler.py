"""A step profiler that tells why ranks wait: input skew, compute skew or synchronization.

Mark the phases of your own step and its end; hvdp's DistributedOptimizer records
the time spent waiting in gradient synchronization itself, as phase ``"sync"``::

    for x, y in loader:
        with hvdp.profiler.phase("data"):
            x, y = next_batch()
        with hvdp.profiler.phase("compute"):
            loss = loss_fn(model(x), y); loss.backward()   # "sync" is measured at its end
        optimizer.step()
        hvdp.profiler.step(examples=len(x))

Nothing is recorded unless profiling is on (``hvdp run --profile DIR`` or
:func:`enable`); when off, each call is a flag check. When on, every rank appends
one JSON line per step to ``DIR/rank<N>.jsonl``; ``hvdp report DIR`` reads them.
"""

from __future__ import annotations

import functools
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, TypeVar

#: ``hvdp run --profile DIR`` sets this for every process.
ENV_VAR = "HVDP_PROFILE_DIR"
#: The phases ``hvdp report`` knows; others are recorded and reported as given.
PHASES = ("data", "compute", "sync")

T = TypeVar("T")
#: Records reach the file at least this often (and when the process exits).
FLUSH_SECONDS = 1.0


@dataclass
class Recorder:
    """This process's recording: where it goes, the step being timed, and the sync timers to read."""

    directory: Optional[Path] = None
    file: Optional[IO[str]] = None
    phases: Dict[str, float] = field(default_factory=dict)
    step: int = 0
    step_start: Optional[float] = None
    sources: List[Callable[[], float]] = field(default_factory=list)
    last_flush: float = 0.0
    #: seconds taken by phases nested in each open phase, innermost last
    open_phases: List[float] = field(default_factory=list)
    #: this process's rank in the running job, None before hvdp.init() (the runtime sets it:
    #: the profiler sits below the runtime and the backends, which record into it)
    rank: Callable[[], Optional[int]] = lambda: None


_recorder = Recorder()


def enable(directory: Optional[str] = None) -> None:
    """Turn recording on, writing to ``directory`` (default: ``$HVDP_PROFILE_DIR``).

    Example:
        >>> hvdp.profiler.enable("/tmp/profile")  # doctest: +SKIP
    """
    chosen = directory or os.environ.get(ENV_VAR)
    if not chosen:
        raise ValueError("hvdp.profiler.enable() needs a directory: enable('/path') or hvdp run --profile DIR.")
    _recorder.directory = Path(chosen)


def disable() -> None:
    """Turn recording off and close this rank's file."""
    _recorder.directory = None
    if _recorder.file is not None:
        _recorder.file.close()
        _recorder.file = None


def is_enabled() -> bool:
    """True when steps are being recorded (``enable()`` or ``$HVDP_PROFILE_DIR``)."""
    if _recorder.directory is None and os.environ.get(ENV_VAR):
        enable()
    return _recorder.directory is not None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed code as phase ``name`` of the current step.

    A phase inside another counts for itself only: the torch optimizer's ``"sync"``
    (the end of ``backward()``) inside a ``"compute"`` block is taken out of ``"compute"``.

    Example:
        >>> with hvdp.profiler.phase("data"):  # doctest: +SKIP
        ...     x, y = next(batches)
    """
    if not is_enabled():
        yield
        return
    with _section(name):
        yield


@contextmanager
def _section(name: str) -> Iterator[None]:
    _start_step_clock()
    start = time.perf_counter()
    open_phases = _recorder.open_phases
    open_phases.append(0.0)
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        nested = open_phases.pop()
        if open_phases:
            open_phases[-1] += elapsed
        record(name, elapsed - nested)


def record(name: str, seconds: float) -> None:
    """Add ``seconds`` to phase ``name`` of the current step (hvdp uses it for ``"sync"``)."""
    if is_enabled():
        _start_step_clock()
        _recorder.phases[name] = _recorder.phases.get(name, 0.0) + seconds


def timed(function: Callable[..., T], name: str = "sync") -> Callable[..., T]:
    """``function``, with the time each call takes recorded as phase ``name`` when profiling is on.

    Example:
        >>> optimizer.synchronize = hvdp.profiler.timed(optimizer.synchronize)  # doctest: +SKIP
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        if not is_enabled():
            return function(*args, **kwargs)
        with _section(name):
            return function(*args, **kwargs)

    return wrapper


def add_source(read_and_reset: Callable[[], float]) -> None:
    """Register a sync timer that is read (and reset) at each step, e.g. one kept inside a tf.function."""
    _recorder.sources.append(read_and_reset)


def step(examples: Optional[int] = None) -> None:
    """End the current step: write its phases and duration for this rank.

    Args:
        examples: examples this replica processed in the step (for examples/second).
    """
    r = _recorder
    if not is_enabled():
        return
    now = time.perf_counter()
    for source in r.sources:
        seconds = source()
        if seconds:
            r.phases["sync"] = r.phases.get("sync", 0.0) + seconds
    if r.file is None and r.directory is not None:
        r.file = _open_rank_file(r.directory)
    if r.file is None:
        return
    line = {"step": r.step, "time": time.time(), "seconds": now - (r.step_start or now),
            "phases": {name: round(value, 9) for name, value in r.phases.items()}, "examples": examples}
    r.file.write(json.dumps(line) + "\n")
    if now - r.last_flush > FLUSH_SECONDS:  # flushing every step would cost more than the records
        r.file.flush()
        r.last_flush = now
    r.step += 1
    r.phases.clear()
    r.step_start = now


def _start_step_clock() -> None:
    if _recorder.step_start is None:
        _recorder.step_start = time.perf_counter()


def _open_rank_file(directory: Path) -> IO[str]:
    import atexit

    directory.mkdir(parents=True, exist_ok=True)
    rank = _recorder.rank()
    if rank is None:  # recording from the start of the process, before hvdp.init()
        rank = int(os.environ.get("HOROVOD_RANK", "0"))
    handle = (directory / f"rank{rank}.jsonl").open("a")
    atexit.register(handle.close)
    return handle


def rank_from(rank: Callable[[], Optional[int]]) -> None:
    """Name each rank's file by ``rank()`` (the runtime gives its job's rank; None before init)."""
    _recorder.rank = rank

"""How a benchmark process times its steps: wall seconds per measured step, CPU seconds per step."""

from __future__ import annotations

import resource
import time
from typing import Any, Callable, Dict, List

#: Synthetic batches per rank, cycled through (enough to defeat caching, small in memory).
POOL = 4


#: CPU seconds (all threads of this process, user + system) per measured step, set by timed_steps.
CPU_PER_STEP: List[float] = []


#: What a train task measured of memory, every rank's (``state_bytes``, ``peak_rss_bytes``), when it was asked to.
MEMORY: Dict[str, Any] = {}


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_steps(step: Callable[[int], None], warmup: int, steps: int) -> List[float]:
    """Wall seconds of each measured step (after ``warmup`` unmeasured ones); CPU time in CPU_PER_STEP."""
    for i in range(warmup):
        step(i)
    times = []
    cpu = _cpu_seconds()
    for i in range(steps):
        start = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - start)
    CPU_PER_STEP[:] = [(_cpu_seconds() - cpu) / max(1, steps)]
    return times

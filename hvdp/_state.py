"""This process's job state, in one object: what hvdp knows of the job it runs in, from every layer.

:mod:`hvdp._runtime` holds the backend in it and starts and ends the job; the drift guard
(:mod:`hvdp.consistency`) counts the job's steps in it; the direct path (:mod:`hvdp.backends`) keeps its
choices there (the controller its calls run on, the quiet loop, the MPI peer's communicators, the
sender threads, what it has said once). Each module reads and writes its own fields through
:func:`job`, never a global of its own, so a test puts a fresh :class:`JobState` in its place, and one
look at it tells everything a process carries from one call to the next.

Caches that are not facts of the job stay with their code: the memory kept for large results, the
handles of the build's C entries, the profiler's recorder (it spans jobs: ``HVDP_PROFILE``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class JobState:
    """Everything hvdp knows about this process's job (tests build fresh ones).

    The runtime's (:mod:`hvdp._runtime`):
        backend: the loaded backend, a :class:`hvdp.backends.base.Backend` (it stays loaded across shutdown/init;
            typed loosely here, the foundation importing nothing above it: :func:`hvdp._runtime.current` types it).
        generation: changes at every start and shutdown; process sets registered in an
            earlier generation are stale.
        dynamic_sets: whether process sets may be added while the job runs.
        unnamed: per (generation, process set) count of unnamed collectives.
        exit_handler: whether the at-exit shutdown is registered.

    The drift guard's (:mod:`hvdp.consistency`):
        job_steps: updates taken by this rank's whole-job DistributedOptimizers.
        guards: the whole-job drift guards, oldest first (the newest are checked once more at the end).

    The direct path's (:mod:`hvdp.backends`):
        controller: what the torch direct calls run on (``gloo``, ``mpi``, ``""`` for none; None: not yet
            decided, it is after Horovod's init).
        local_memory: the torch shared-memory allreduce, in a list of one once made (None in it: no exchange).
        senders: the torch gradient sender threads, by channel.
        gradient_paths, groups: the live torch direct gradient paths and direct reducer groups (weakly held).
        calls_agreed: whether this process made a header exchange since init (it says when it has finished).
        went_direct: whether a TensorFlow gradients' call of this process went direct.
        quiet_loop: whether Horovod's background loop is spaced out (the gradients go direct).
        shm_fallback_said: whether the fallback from shared memory was said (once per process).
        mpi: the MPI peer's state (``reason`` it cannot run, its ``comms``, its exchange buffers).
    """

    backend: Any = None
    generation: int = 0
    dynamic_sets: bool = False
    unnamed: Dict[Tuple[int, Optional[Tuple[int, ...]]], int] = field(default_factory=dict)
    exit_handler: bool = False

    job_steps: int = 0
    guards: List[Any] = field(default_factory=list)

    controller: Optional[str] = None
    local_memory: List[Any] = field(default_factory=list)
    senders: Dict[int, Any] = field(default_factory=dict)
    gradient_paths: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    groups: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    calls_agreed: bool = False
    went_direct: bool = False
    quiet_loop: bool = False
    shm_fallback_said: bool = False
    mpi: Dict[Any, Any] = field(default_factory=dict)


_job = JobState()


def job() -> JobState:
    """This process's :class:`JobState`."""
    return _job


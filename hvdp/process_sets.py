"""Training on part of a job: MPI communicators and process sets, framework-neutral.

Two ways to run hvdp on fewer processes than the job has:

* ``hvdp.init(comm=...)`` with an mpi4py communicator (or a list of MPI ranks):
  hvdp runs on exactly those processes; the others never call ``hvdp.init``
  and are free to do other MPI work (checked in :mod:`hvdp.communicators`).
* :class:`ProcessSet`: groups of hvdp ranks that each train their own model,
  side by side in one job (ensembles, hyper-parameter sweeps). Pass the set as
  ``process_set=`` to ``DistributedOptimizer``, ``broadcast_state``, the
  collectives, ``check_consistency`` and ``shard``.

Inside a process set, ranks are numbered ``0 .. size()-1`` in increasing order
of their hvdp ranks (as Horovod does), and ``root_rank=`` counts in that numbering.
This module knows no framework: the backends create Horovod's process sets.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from hvdp import _runtime
from hvdp.communicators import check_ranks, world_size_hint
from hvdp.errors import ProcessSetError

#: What ``hvdp.init(process_sets=...)`` takes besides a list: sets added later with ``add_process_set``.
DYNAMIC = "dynamic"


class ProcessSet:
    """A group of hvdp ranks that trains one model (or runs collectives) together.

    Create the same sets, in the same order, on every rank, and register them
    with ``hvdp.init(process_sets=[...])`` (or with :func:`hvdp.add_process_set`
    after ``hvdp.init(process_sets="dynamic")``). Sets may overlap; a rank only
    calls the collectives of the sets it is in.

    Args:
        ranks: the hvdp ranks in the set (distinct, ``>= 0``; any order).

    Example:
        >>> sets = [ProcessSet([0, 1]), ProcessSet([2, 3])]
        >>> sets[1]
        hvdp.ProcessSet([2, 3])
        >>> hvdp.init(process_sets=sets)                 # doctest: +SKIP
        >>> mine = hvdp.my_process_set(sets)              # doctest: +SKIP
        >>> opt = hvdp.DistributedOptimizer(opt, model, process_set=mine)  # doctest: +SKIP
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks: Tuple[int, ...] = check_ranks(ranks, "hvdp.ProcessSet(ranks)")
        self._handle: Any = None
        self._generation = -1

    def __repr__(self) -> str:
        return f"hvdp.ProcessSet({list(self.ranks)})"

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """True when this process is in the set (needs ``hvdp.init()``).

        Example:
            >>> if ps.included():           # doctest: +SKIP
            ...     hvdp.barrier(process_set=ps)
        """
        return _runtime.current("ProcessSet.included").rank() in self.ranks

    def rank(self) -> int:
        """This process's rank inside the set, ``0 <= rank() < size()``.

        Raises:
            ProcessSetError: this process is not in the set.
        """
        rank = _runtime.current("ProcessSet.rank").rank()
        if rank not in self.ranks:
            raise ProcessSetError(
                f"{self!r}.rank() was called on rank {rank}, which is not in the set. "
                "Check ps.included() first, or use hvdp.my_process_set(sets)."
            )
        return self.ranks.index(rank)


def check_process_sets(
    process_sets: Union[Sequence[ProcessSet], str, None],
    comm: Any,
    environ: Optional[Mapping[str, str]] = None,
) -> Tuple[List[ProcessSet], bool]:
    """Validate ``hvdp.init(process_sets=...)``: (the sets, whether sets may be added later).

    Example:
        >>> check_process_sets("dynamic", None)
        ([], True)
    """
    if process_sets is None:
        return [], False
    if isinstance(process_sets, str):
        if process_sets != DYNAMIC:
            raise ValueError(
                f"process_sets={process_sets!r}; expected a list of hvdp.ProcessSet or {DYNAMIC!r} "
                "(to add sets later with hvdp.add_process_set)."
            )
        return [], True
    if isinstance(process_sets, ProcessSet) or not isinstance(process_sets, Sequence):
        raise TypeError(
            f"process_sets must be a list of hvdp.ProcessSet, got {process_sets!r}. "
            "Example: hvdp.init(process_sets=[hvdp.ProcessSet([0, 1]), hvdp.ProcessSet([2, 3])])."
        )
    sets: List[ProcessSet] = []
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise TypeError(
                f"process_sets must hold hvdp.ProcessSet objects, got {ps!r}: wrap the ranks, "
                f"hvdp.ProcessSet({ps!r}), and keep the object to pass as process_set=."
            )
        sets.append(ps)
    seen: Dict[Tuple[int, ...], ProcessSet] = {}
    for ps in sets:
        if ps.ranks in seen:
            raise ProcessSetError(
                f"process_sets lists the ranks {list(ps.ranks)} twice ({seen[ps.ranks]!r} and {ps!r}); "
                "each set must be different. Create it once and pass that object everywhere."
            )
        seen[ps.ranks] = ps
    world = world_size_hint(comm, os.environ if environ is None else environ)
    if world is not None:
        for ps in sets:
            _check_in_world(ps, world, "hvdp.init(process_sets=...)")
    return sets, _env_dynamic(environ)


def _env_dynamic(environ: Optional[Mapping[str, str]]) -> bool:
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").lower() in ("1", "true", "yes", "on")


def _check_in_world(ps: ProcessSet, world: int, caller: str) -> None:
    outside = [r for r in ps.ranks if r >= world]
    if outside:
        raise ProcessSetError(
            f"{caller}: {ps!r} names rank(s) {outside}, but the job has {world} processes "
            f"(ranks 0..{world - 1}). A process set is a subset of the job's ranks."
        )


def _is_whole_job(ps: ProcessSet, world: Optional[int]) -> bool:
    return world is not None and ps.ranks == tuple(range(world))


def start(
    framework: Optional[str],
    comm: Any,
    process_sets: List[ProcessSet],
    dynamic: bool,
) -> None:
    """Initialize the backend on ``comm`` and register ``process_sets`` (all validated).

    A set holding every rank of the job is the job itself: it is bound to the
    global set rather than registered (Horovod refuses it as a duplicate).
    """
    world = world_size_hint(comm, os.environ)
    native = [ps for ps in process_sets if not _is_whole_job(ps, world)]
    handles = _runtime.activate(framework, comm, [list(ps.ranks) for ps in native], dynamic)
    if handles is None:  # already running, and nothing new was asked for
        return
    _runtime.job().dynamic_sets = dynamic or _env_dynamic(None)
    generation = _runtime.generation()
    for ps in process_sets:
        ps._handle, ps._generation = None, generation
    for ps, handle in zip(native, handles):
        ps._handle = handle


def add(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set while the job runs (all ranks call it, in the same order)."""
    backend = _runtime.current("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps._generation == _runtime.generation():
        raise ProcessSetError(f"hvdp.add_process_set({ps!r}): the set is already registered; use it as it is.")
    _check_in_world(ps, backend.size(), "hvdp.add_process_set")
    if not _runtime.job().dynamic_sets:
        raise ProcessSetError(
            f"hvdp.add_process_set({ps!r}) needs sets to be addable while the job runs: initialize with "
            "hvdp.init(process_sets='dynamic'), or register the sets at start with "
            "hvdp.init(process_sets=[...])."
        )
    handle = None
    if not _is_whole_job(ps, backend.size()):
        handle = backend.add_process_set(list(ps.ranks))
        if handle is None:
            raise ProcessSetError(
                f"hvdp.add_process_set({ps!r}): a set with these ranks is already registered; pass that "
                "set object as process_set= instead of adding the ranks again."
            )
    ps._handle, ps._generation = handle, _runtime.generation()
    return ps


def remove_process_set(process_set: ProcessSet) -> None:
    """Unregister a set added with :func:`hvdp.add_process_set`; every rank calls it, with the same set.

    Its collectives are refused afterwards, and its ranks may be added again (Horovod keeps a
    bounded number of sets: a job that makes groups as it goes removes the ones it is done with).

    Example:
        >>> pair = hvdp.add_process_set([0, 1])               # doctest: +SKIP
        >>> hvdp.remove_process_set(pair)                     # doctest: +SKIP
    """
    backend = _runtime.current("remove_process_set")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"hvdp.remove_process_set takes the hvdp.ProcessSet that hvdp.add_process_set returned, "
                        f"got {process_set!r}.")
    if process_set._generation != _runtime.generation():
        raise ProcessSetError(f"hvdp.remove_process_set({process_set!r}): the set is not registered with the "
                              f"running job (never added, or removed already).")
    if not _runtime.job().dynamic_sets:
        raise ProcessSetError(f"hvdp.remove_process_set({process_set!r}): sets registered at start stay for the "
                              f"whole job; to add and remove sets as it runs, initialize with "
                              f"hvdp.init(process_sets='dynamic') and add them with hvdp.add_process_set.")
    if process_set._handle is not None:  # a set of every rank is the whole job: nothing to remove in Horovod
        backend.remove_process_set(process_set._handle)
    process_set._handle, process_set._generation = None, -1


def handle(process_set: Optional[ProcessSet], caller: str) -> Any:
    """The backend's handle for ``process_set`` (None: the whole job), after checking this rank may use it."""
    if process_set is None:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"hvdp.{caller}(process_set=...) takes an hvdp.ProcessSet registered with hvdp.init(process_sets="
            f"[...]) or hvdp.add_process_set, got {process_set!r}. Keep the hvdp.ProcessSet object and pass it."
        )
    backend = _runtime.current(caller)
    if process_set._generation != _runtime.generation():
        raise ProcessSetError(
            f"hvdp.{caller}(process_set={process_set!r}): the set is not registered with the running job. "
            "Register it: hvdp.init(process_sets=[...]), or hvdp.add_process_set(ps) after "
            "hvdp.init(process_sets='dynamic'). After hvdp.shutdown(), sets must be registered again."
        )
    rank = backend.rank()
    if rank not in process_set.ranks:
        raise ProcessSetError(
            f"hvdp.{caller}(process_set={process_set!r}) was called on rank {rank}, which is not in the set. "
            "Only the set's members call its collectives: guard with ps.included(), or take this rank's set "
            "with hvdp.my_process_set(sets)."
        )
    return process_set._handle


def collective_name(kind: str, name: Optional[str], process_set: Optional[ProcessSet]) -> str:
    """``name``, or for an unnamed collective one counted per process set (:func:`count_call`).

    Horovod names unnamed torch collectives by a per-process counter, which
    differs between ranks as soon as they run collectives in different sets;
    counting per set gives every member the same name for the same call.

    Example:
        >>> collective_name("allreduce", "loss", None)
        'loss'
    """
    count = count_call(process_set)
    if name is not None:
        return name
    where = "" if process_set is None else "[" + ",".join(map(str, process_set.ranks)) + "]"
    return f"hvdp.{kind}{where}.{count}"


def count_call(process_set: Optional[ProcessSet]) -> int:
    """This call's number among the collectives on ``process_set`` since init, whatever their kind or name, so
    that unnamed calls keep the same names on every rank even after a call that differed between ranks (and was
    refused) was, say, an allreduce on one rank and a barrier on another."""
    unnamed = _runtime.job().unnamed
    key = (_runtime.generation(), None if process_set is None else process_set.ranks)
    count = unnamed.get(key, 0)
    unnamed[key] = count + 1
    return count


def members(process_set: Optional[ProcessSet], caller: str) -> List[int]:
    """The hvdp ranks taking part in a call on ``process_set`` (all ranks for None)."""
    if process_set is None:
        return list(range(_runtime.current(caller).size()))
    return list(process_set.ranks)


def mine(process_sets: Sequence[ProcessSet]) -> ProcessSet:
    """The one set among ``process_sets`` that holds this rank.

    Raises:
        ProcessSetError: this rank is in none of them, or in several (overlapping sets).
    """
    if isinstance(process_sets, ProcessSet) or not isinstance(process_sets, Sequence) \
            or not all(isinstance(ps, ProcessSet) for ps in process_sets):
        raise TypeError(f"hvdp.my_process_set takes a list of hvdp.ProcessSet, got {process_sets!r}.")
    rank = _runtime.current("my_process_set").rank()
    found = [ps for ps in process_sets if rank in ps.ranks]
    if not found:
        raise ProcessSetError(
            f"Rank {rank} is in none of the process sets {list(process_sets)!r}. Every rank needs a set: "
            "add this rank to one, or skip training on it (if any(ps.included() for ps in sets))."
        )
    if len(found) > 1:
        raise ProcessSetError(
            f"Rank {rank} is in {len(found)} of the process sets ({', '.join(map(repr, found))}): they overlap, "
            "so hvdp.my_process_set cannot tell which one this rank trains in. Give it sets that split the "
            "ranks without overlap, e.g. [hvdp.ProcessSet([0, 1]), hvdp.ProcessSet([2, 3])], or pass the "
            "set you mean as process_set= yourself."
        )
    return found[0]

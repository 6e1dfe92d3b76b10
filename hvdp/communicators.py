"""``hvdp.init(comm=...)``: hvdp on part of an MPI job, and the checks of rank lists it shares with process sets.

hvdp runs on exactly the processes of an mpi4py communicator (or of a list of MPI ranks);
the others never call ``hvdp.init`` and are free to do other MPI work. mpi4py is never
imported here: a communicator passed in means it is in use.
"""

from __future__ import annotations

import numbers
import os
import sys
from typing import Any, Iterable, Mapping, Optional, Tuple

from hvdp.errors import ProcessSetError

#: Environment variables that tell an MPI process its rank and the size of MPI_COMM_WORLD.
_MPI_WORLD_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
def check_ranks(ranks: object, what: str) -> Tuple[int, ...]:
    """``ranks`` as a sorted tuple of distinct ints >= 0, or a TypeError/ProcessSetError saying why not."""
    if is_communicator(ranks):
        raise TypeError(
            f"{what} takes hvdp rank numbers, got an mpi4py communicator. Pass the hvdp ranks of its "
            "members, the same list on every rank (e.g. hvdp.ProcessSet([0, 1])); to run hvdp on "
            "a communicator's processes only, use hvdp.init(comm=communicator)."
        )
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"{what} takes a list of rank numbers such as [0, 1], got {ranks!r}.")
    values = list(ranks)
    bad = [r for r in values if isinstance(r, bool) or not isinstance(r, numbers.Integral) or int(r) < 0]
    if bad:
        raise TypeError(f"{what}: ranks must be integers >= 0, got {bad!r} in {values!r}.")
    if not values:
        raise ProcessSetError(f"{what}: the list of ranks is empty; give at least one rank, e.g. [0, 1].")
    as_ints = [int(r) for r in values]
    repeated = sorted({r for r in as_ints if as_ints.count(r) > 1})
    if repeated:
        raise ProcessSetError(f"{what}: rank(s) {repeated} appear more than once in {as_ints}; list each rank once.")
    return tuple(sorted(as_ints))


def is_communicator(obj: object) -> bool:
    """True for an mpi4py communicator (mpi4py is never imported here: such an object means it is)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(obj, mpi.Comm)


def _mpi_world(environ: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    """(rank, size) of this process in MPI_COMM_WORLD, from mpi4py if it is in use, else from mpirun's variables."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    for rank_var, size_var in _MPI_WORLD_VARS:
        if environ.get(rank_var, "").isdigit() and environ.get(size_var, "").isdigit():
            return int(environ[rank_var]), int(environ[size_var])
    return None


def _refuse_gloo(comm: object, environ: Mapping[str, str]) -> None:
    if environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        raise ProcessSetError(
            f"hvdp.init(comm={comm!r}) needs Horovod's MPI controller, but this job was started with Gloo "
            "(hvdp run / horovodrun --gloo). Launch it with hvdp run --mpi or mpirun, or drop comm=."
        )


def check_comm(comm: object, environ: Optional[Mapping[str, str]] = None) -> Any:
    """Validate ``hvdp.init(comm=...)``: None, an mpi4py intracommunicator, or a list of MPI ranks.

    A rank list names ranks of MPI_COMM_WORLD (hvdp rank i is the i-th listed);
    every listed process, and only those, calls ``hvdp.init(comm=...)``.

    Returns:
        ``comm`` as Horovod takes it (a rank list becomes a list of ints).

    Example:
        >>> check_comm(None) is None
        True
    """
    if comm is None:
        return None
    env = os.environ if environ is None else environ
    if is_communicator(comm):
        mpi = sys.modules["mpi4py.MPI"]
        if not isinstance(comm, mpi.Intracomm):
            raise TypeError(
                f"hvdp.init(comm=...) takes an intracommunicator (such as MPI.COMM_WORLD.Split(color)), "
                f"got a {type(comm).__name__}. Use one side's local communicator."
            )
        if comm == mpi.COMM_NULL:
            raise ProcessSetError(
                "hvdp.init(comm=MPI.COMM_NULL): this process is not in the communicator (Split with "
                "color MPI.UNDEFINED gives COMM_NULL). Only the processes in it call hvdp.init(comm=...); "
                "the others skip hvdp (they may do other MPI work)."
            )
        _refuse_gloo("<mpi4py communicator>", env)
        return comm
    if isinstance(comm, (str, bytes)) or not isinstance(comm, Iterable):
        raise TypeError(
            f"hvdp.init(comm=...) takes an mpi4py communicator (e.g. MPI.COMM_WORLD.Split(color)) or a list of "
            f"MPI ranks, got {type(comm).__module__}.{type(comm).__qualname__}: {comm!r}. If this is a "
            "communicator of another MPI binding, use mpi4py's (pip install mpi4py==4.1.2)."
        )
    listed = list(comm)
    ranks = check_ranks(listed, f"hvdp.init(comm={listed!r})")
    _refuse_gloo(listed, env)
    world = _mpi_world(env)
    if world is None:
        raise ProcessSetError(
            f"hvdp.init(comm={listed!r}) names MPI ranks, but this process was not started by an MPI launcher "
            "(no OMPI_COMM_WORLD_RANK or PMI_RANK, and mpi4py is not in use). Launch with mpirun or "
            "hvdp run --mpi, or drop comm=."
        )
    world_rank, world_size = world
    outside = [r for r in ranks if r >= world_size]
    if outside:
        raise ProcessSetError(
            f"hvdp.init(comm={listed!r}): rank(s) {outside} are not in this MPI job of {world_size} processes "
            f"(ranks 0..{world_size - 1}). List a subset of 0..{world_size - 1}."
        )
    if world_rank not in ranks:
        raise ProcessSetError(
            f"hvdp.init(comm={listed!r}) was called on MPI rank {world_rank}, which is not in the list. Only "
            "the listed processes call hvdp.init(comm=...); the others skip hvdp (they may do other MPI work)."
        )
    return [int(r) for r in listed]


def world_size_hint(comm: Any, environ: Mapping[str, str]) -> Optional[int]:
    """The number of hvdp ranks the job will have, when it can be told before Horovod starts."""
    if isinstance(comm, list):
        return len(comm)
    if comm is not None:
        return int(comm.Get_size())
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return None

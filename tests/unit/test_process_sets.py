"""comm= and process sets in one process: validation, and what the facade hands the backend.

A fake backend stands in for Horovod, so these run without a job; the parallel
tests (tests/parallel/test_mpi_groups.py) run the real thing on 4 processes.
"""

from __future__ import annotations

import pytest

import hvdp
from hvdp import _runtime, _state, communicators
from hvdp import process_sets as ps_module


class FakeBackend:
    """Records what the facade dispatches; this process is rank 1 of 4."""

    name = "torch"

    def __init__(self) -> None:
        self.calls: list = []

    def is_initialized(self) -> bool:
        return True

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 4

    def controller(self) -> str:
        return "mpi"

    def allreduce(self, value, op, name, process_set):
        self.calls.append(("allreduce", op, name, process_set))
        return value

    def broadcast(self, value, root_rank, name, process_set):
        self.calls.append(("broadcast", root_rank, name, process_set))
        return value

    def broadcast_state(self, model, optimizer, root_rank, process_set):
        self.calls.append(("broadcast_state", root_rank, process_set))


@pytest.fixture
def fake(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(_state, "_job", _state.JobState(backend=backend))
    return backend


def registered(ranks, handle="handle"):
    """A ProcessSet as hvdp.init(process_sets=...) leaves it."""
    ps = hvdp.ProcessSet(ranks)
    ps._handle, ps._generation = handle, _runtime.generation()
    return ps


# --- hvdp.init(comm=...) ----------------------------------------------------------------------

MPI_RANK_1_OF_4 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}


@pytest.mark.parametrize("comm", [object(), "0,1", 3])
def test_a_comm_that_is_not_a_communicator_or_rank_list_is_a_type_error(comm):
    with pytest.raises(TypeError, match=r"hvdp.init\(comm=...\) takes an mpi4py communicator .* got "):
        hvdp.init("torch", comm=comm)
    assert not hvdp.is_initialized()


def test_the_error_names_the_type_received():
    class Comm:
        pass

    with pytest.raises(TypeError, match=r"got test_process_sets\..*Comm"):
        communicators.check_comm(Comm(), MPI_RANK_1_OF_4)


def test_a_rank_list_outside_the_mpi_job_is_refused():
    with pytest.raises(hvdp.ProcessSetError, match=r"rank\(s\) \[4, 5\] are not in this MPI job of 4 processes"):
        communicators.check_comm([1, 4, 5], MPI_RANK_1_OF_4)


def test_a_process_outside_the_rank_list_may_not_init():
    with pytest.raises(hvdp.ProcessSetError, match="called on MPI rank 1, which is not in the list"):
        communicators.check_comm([0, 2], MPI_RANK_1_OF_4)


@pytest.mark.parametrize("comm, message", [([], "the list of ranks is empty"),
                                           ([1, 1], r"rank\(s\) \[1\] appear more than once"),
                                           ([1, -1], "ranks must be integers >= 0"),
                                           ([1, True], "ranks must be integers >= 0")])
def test_bad_rank_lists_are_refused(comm, message):
    with pytest.raises((TypeError, ValueError), match=message):
        communicators.check_comm(comm, MPI_RANK_1_OF_4)


def test_a_rank_list_needs_mpi_not_gloo():
    with pytest.raises(hvdp.ProcessSetError, match="needs Horovod's MPI controller.*hvdp run --mpi or mpirun"):
        communicators.check_comm([0, 1], {**MPI_RANK_1_OF_4, "HOROVOD_CONTROLLER": "gloo"})
    with pytest.raises(hvdp.ProcessSetError, match="not started by an MPI launcher"):
        communicators.check_comm([0, 1], {})


def test_a_valid_rank_list_passes_in_its_order():
    assert communicators.check_comm((3, 1), MPI_RANK_1_OF_4) == [3, 1]
    assert communicators.check_comm(None, {}) is None


# --- hvdp.ProcessSet and hvdp.init(process_sets=...) ------------------------------------------

@pytest.mark.parametrize("ranks, error, message", [
    ([], hvdp.ProcessSetError, "empty"), ([0, 0], hvdp.ProcessSetError, "more than once"),
    ("01", TypeError, "a list of rank numbers"), (None, TypeError, "a list of rank numbers"),
    ([0, 1.5], TypeError, "integers >= 0")])
def test_bad_process_sets_are_refused(ranks, error, message):
    with pytest.raises(error, match=message):
        hvdp.ProcessSet(ranks)


def test_process_set_ranks_are_sorted_and_numbered_in_that_order():
    ps = hvdp.ProcessSet([3, 1])
    assert ps.ranks == (1, 3) and ps.size() == 2 and repr(ps) == "hvdp.ProcessSet([1, 3])"


def test_init_process_sets_is_validated_before_anything_starts():
    a = hvdp.ProcessSet([0, 1])
    with pytest.raises(ValueError, match="expected a list of hvdp.ProcessSet or 'dynamic'"):
        hvdp.init("torch", process_sets="static")
    with pytest.raises(TypeError, match=r"wrap the ranks, hvdp.ProcessSet\(\[2, 3\]\)"):
        hvdp.init("torch", process_sets=[a, [2, 3]])
    with pytest.raises(hvdp.ProcessSetError, match=r"lists the ranks \[0, 1\] twice"):
        hvdp.init("torch", process_sets=[a, hvdp.ProcessSet([1, 0])])
    with pytest.raises(hvdp.ProcessSetError, match=r"names rank\(s\) \[5\], but the job has 4 processes"):
        ps_module.check_process_sets([hvdp.ProcessSet([0, 5])], None, {"HOROVOD_SIZE": "4"})
    assert not hvdp.is_initialized()


def test_init_with_groups_while_running_is_refused(fake):
    with pytest.raises(hvdp.ProcessSetError, match="already initialized.*shutdown"):
        _runtime.activate("torch", None, [[0, 1]], False)


# --- what the facade checks and dispatches -----------------------------------------------------

def test_root_rank_counts_inside_the_set_and_reaches_the_backend_as_a_job_rank(fake):
    group = registered([1, 3])
    hvdp.broadcast(1.0, root_rank=1, process_set=group)
    hvdp.broadcast_state(object(), process_set=group)
    assert fake.calls[0][:2] == ("broadcast", 3) and fake.calls[0][3] == "handle"
    assert fake.calls[1] == ("broadcast_state", 1, "handle")
    with pytest.raises(ValueError, match=r"root_rank=2 is not a rank of hvdp.ProcessSet\(\[1, 3\]\)"):
        hvdp.broadcast(1.0, root_rank=2, process_set=group)


def test_unnamed_collectives_are_named_per_set(fake):
    a, b = registered([0, 1], "a"), registered([1, 2], "b")
    for group in (a, a, b, None):
        hvdp.allreduce(1.0, process_set=group)
    names = [call[2] for call in fake.calls]
    assert names[0] != names[1] and len(set(names)) == 4
    assert names[2].endswith(".0") and names[3].endswith(".0")  # each set counts its own calls


def test_a_set_this_rank_is_not_in_is_refused(fake):
    with pytest.raises(hvdp.ProcessSetError, match=r"called on rank 1, which is not in the set"):
        hvdp.allreduce(1.0, process_set=registered([2, 3]))
    assert fake.calls == []


def test_an_unregistered_or_stale_set_is_refused(fake, monkeypatch):
    with pytest.raises(hvdp.ProcessSetError, match="not registered with the running job"):
        hvdp.allreduce(1.0, process_set=hvdp.ProcessSet([0, 1]))
    group = registered([0, 1])
    monkeypatch.setattr(_runtime.job(), "generation", _runtime.generation() + 1)  # as after shutdown + init
    with pytest.raises(hvdp.ProcessSetError, match="After hvdp.shutdown"):
        hvdp.barrier(process_set=group)


def test_ranks_instead_of_a_set_is_a_type_error(fake):
    with pytest.raises(TypeError, match=r"takes an hvdp.ProcessSet .* got \[0, 1\]"):
        hvdp.allgather_object(1, process_set=[0, 1])


def test_adasum_on_a_set_is_refused(fake):
    with pytest.raises(ValueError, match="op='adasum' runs on the whole job only"):
        hvdp.allreduce(1.0, op="adasum", process_set=registered([0, 1]))


def test_my_process_set_needs_sets_that_do_not_overlap(fake):
    a, b, c = hvdp.ProcessSet([0, 1]), hvdp.ProcessSet([2, 3]), hvdp.ProcessSet([1, 2])
    assert hvdp.my_process_set([a, b]) is a
    with pytest.raises(hvdp.ProcessSetError, match="Rank 1 is in 2 of the process sets .* they overlap"):
        hvdp.my_process_set([a, b, c])
    with pytest.raises(hvdp.ProcessSetError, match="Rank 1 is in none of the process sets"):
        hvdp.my_process_set([b])
    assert (a.rank(), a.included(), b.included()) == (1, True, False)
    with pytest.raises(hvdp.ProcessSetError, match="not in the set"):
        b.rank()


def test_add_process_set_needs_dynamic_sets(fake, monkeypatch):
    monkeypatch.setattr(_runtime.job(), "dynamic_sets", False)
    with pytest.raises(hvdp.ProcessSetError, match="initialize with hvdp.init\\(process_sets='dynamic'\\)"):
        hvdp.add_process_set([0, 1])
    with pytest.raises(hvdp.ProcessSetError, match="but the job has 4 processes"):
        hvdp.add_process_set([0, 9])


def test_public_names_are_exported():
    for name in ("ProcessSet", "ProcessSetError", "add_process_set", "my_process_set"):
        assert name in hvdp.__all__ and getattr(hvdp, name) is not None

"""Collective calls that differ between ranks are refused on every rank within seconds, naming each rank's call,
and the job goes on (torch, Gloo at np=2 and np=3, MPI at np=2: hvdp.backends.direct_mpi; --stall-timeout 60,
so a hang would show as a minute): ops, kinds, roots, names, dtypes and shapes, at 4 KB (one direct exchange),
1 MB (the ring) and on Horovod's path (an op or dtype only it has). The path each call takes is chosen from
headers every rank exchanges (hvdp.backends.torch.direct.calls), so two ranks never wait in two mechanisms. A rank
that finishes its script while another still calls: test_leave_early.py."""

from __future__ import annotations

import pytest
from harness import WORKERS, run_job

#: case: a word every rank's error must contain (besides each rank's call)
REFUSED = {
    "op 4 KB": "allreduce sum", "op 1 MB": "allreduce max", "kind allreduce/allgather": "hvdp.allgather",
    "kind allreduce/broadcast": "hvdp.broadcast", "kind allreduce/barrier": "hvdp.barrier",
    "kind allgather/allgather_object": "hvdp.allgather_object", "kind broadcast_object/allreduce":
    "hvdp.broadcast_object", "root": "from rank 1", "name": "named b", "dtype float16/float32": "float16[1024]",
    "shape 1 MB": "float32[262143]", "grouped/allreduce": "grouped allreduce",
}


@pytest.fixture(scope="module", params=[(2, "gloo"), (3, "gloo"), (2, "mpi")], ids=lambda p: f"np{p[0]}-{p[1]}")
def job(request, tmp_path_factory):
    size, controller = request.param
    out = tmp_path_factory.mktemp(f"mismatched{size}{controller}")
    job = run_job([f"--{controller}", "--framework", "torch", "--stall-timeout", "60",
                   str(WORKERS / "mismatched_calls.py")], out, np_=size, timeout=300)
    assert job.returncode == 0, job.why()
    assert [r["rank"] for r in job.ranks] == list(range(size)), job.why()
    return job


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_call_that_differs_is_refused_on_every_rank_within_seconds_and_the_job_goes_on(job, case):
    size = len(job.ranks)
    for r in job.ranks:
        got = r["cases"][case]
        assert got["raised"] is not None and got["raised"].startswith("TensorMismatchError: "), (r["rank"], got)
        assert REFUSED[case] in got["raised"], (r["rank"], got)
        assert all(f"rank {q}: " in got["raised"] for q in range(size)), (r["rank"], got)  # names every rank's
        assert got["seconds"] < 10, (r["rank"], got)  # at once: not the 60 s stall timeout
        assert got["after"] == sum(range(size)), (r["rank"], got)


def test_calls_alike_where_it_matters_are_not_refused(job):
    size = len(job.ranks)
    for r in job.ranks:
        assert r["grad on one rank"] == [float(size)] * 4  # a gradient on one rank: Horovod's path on every rank
        assert r["allgather rows"] == sum(range(1, size + 1))  # first dimensions that differ
        assert r["max 1 MB"] == float(size)
        assert r["numpy"] == [float(size)] * 3

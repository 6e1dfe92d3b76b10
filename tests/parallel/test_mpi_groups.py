"""hvdp inside MPI programs, on 4 processes (2 cores, oversubscribed), both frameworks.

* comm_subset.py: under plain `mpirun -np 4` (and `hvdp run -np 4 --mpi`), ranks 0-1 train
  with hvdp.init(comm=...) while ranks 2-3, which never start hvdp, run mpi4py collectives.
* process_sets.py: sets [0, 1] and [2, 3] train two models at once (registered at init, or added
  while running; each way under plain mpirun and under `hvdp run` (Gloo)); then, in the
  same job, each set of three partitions of the 4 ranks trains like one process on its members' data.
* examples/ensemble.py: each set's first member prints its model's accuracy.
"""

from __future__ import annotations

import re

import pytest
from harness import REPO, WORKERS, Job, run_job, run_mpirun

TIMEOUT = 300
TOLERANCE = 1e-5  # distributed vs one process on the union of the batches (float32)


def launch(script: str, args: list, launcher: str, framework: str, out_dir) -> Job:
    """Run SCRIPT ARGS on 4 processes with `mpirun`, `hvdp run --mpi` or `hvdp run` (Gloo)."""
    if launcher == "mpirun":
        job = run_mpirun([script, *args], out_dir, np_=4, timeout=TIMEOUT)
    else:
        controller = ["--mpi"] if launcher == "hvdp-run-mpi" else ["--gloo"]
        job = run_job([*controller, "--framework", framework, script, *args], out_dir, np_=4, timeout=TIMEOUT)
    assert job.returncode == 0, f"{script} {args} ({launcher}) exited {job.returncode}:\n{job.why(6000)}"
    return job


def with_reports(job: Job) -> list:
    assert [r["rank"] for r in job.ranks] == [0, 1, 2, 3], f"missing rank reports:\n{job.why()}"
    return job.ranks


# --- hvdp.init(comm=...): hvdp on part of an MPI job ------------------------------------------

SUBSET_JOBS = [("torch", "comm", "mpirun"), ("tensorflow", "comm", "mpirun"), ("torch", "ranks", "hvdp-run-mpi")]


@pytest.fixture(scope="module", params=SUBSET_JOBS, ids=["-".join(p) for p in SUBSET_JOBS])
def subset(request, tmp_path_factory):
    framework, mode, launcher = request.param
    job = launch(str(WORKERS / "comm_subset.py"), [framework, mode], launcher, framework,
                 tmp_path_factory.mktemp("subset"))
    return with_reports(job)


def test_hvdp_runs_on_exactly_the_processes_of_the_communicator(subset):
    trainers, others = subset[:2], subset[2:]
    for r in trainers:
        assert (r["hvdp_rank"], r["hvdp_size"]) == (r["rank"], 2)
        assert r["sum_of_ranks"] == 3, "an allreduce reached processes outside the communicator"
        assert r["world_ranks"] == [0, 1]
    assert [r["hvdp_initialized"] for r in others] == [False, False]


def test_training_on_the_subset_keeps_replicas_identical(subset):
    r0, r1 = subset[:2]
    assert r0["digest_before_broadcast"] != r1["digest_before_broadcast"], "replicas did not start different"
    assert r0["digest_after_broadcast"] == r1["digest_after_broadcast"]
    assert r0["losses"] != r1["losses"], "the two ranks saw the same data"
    assert r0["digest"] == r1["digest"], "replicas differ after training"
    for r in (r0, r1):
        assert r["changed"] > 1e-3, "training changed nothing"
        assert r["vs_single_process"] <= TOLERANCE, "gradients were not averaged over exactly the 2 ranks"


def test_the_other_ranks_run_mpi_collectives_meanwhile(subset):
    trainers, others = subset[:2], subset[2:]
    for r in others:
        assert r["mpi_peers"] == 2 and r["mpi_sums"] == [5], "mpi4py allreduce among ranks 2 and 3 was wrong"
        assert r["mpi_collectives"] >= 2
        assert r["work_started"] < min(t["train_started"] for t in trainers)
        assert r["work_finished"] >= max(t["train_finished"] for t in trainers)


def test_a_comm_that_does_not_fit_is_refused_with_the_fix(subset):
    for r in subset:
        errors = r["errors"]
        assert errors["not_a_communicator"].startswith("TypeError: hvdp.init(comm=...) takes an mpi4py communicator")
        assert "builtins.object" in errors["not_a_communicator"]
        assert errors["outside_the_world"].startswith("ProcessSetError: hvdp.init(comm=[0, 7]): rank(s) [7]")
        assert "4 processes" in errors["outside_the_world"]
        assert "rank(s) [0] appear more than once" in errors["repeated_rank"]
    for r in subset[2:]:
        assert r["errors"]["comm_null"].startswith("ProcessSetError: hvdp.init(comm=MPI.COMM_NULL)")
        assert f"MPI rank {r['rank']}, which is not in the list" in r["errors"]["not_listed"]


# --- process sets: several models in one job -------------------------------------------------

#: One job per (framework, registration, launcher), the sets' checks and the partitions' in each. Four jobs
#: hold every pair of the three: each framework registers its sets both ways (its own add_process_set when
#: dynamic) and runs under both controllers (Gloo's contexts per set under `hvdp run`, MPI's communicators
#: under plain mpirun), and each registration runs under both. torch's jobs add the sharded Adam per
#: partition and the BatchNorm buffers.
SET_JOBS = [("torch", "static", "mpirun"), ("tensorflow", "static", "hvdp-run-gloo"),
            ("torch", "dynamic", "hvdp-run-gloo"), ("tensorflow", "dynamic", "mpirun")]


@pytest.fixture(scope="module", params=SET_JOBS, ids=["-".join(p) for p in SET_JOBS])
def sets_job(request, tmp_path_factory):
    framework, mode, launcher = request.param
    job = launch(str(WORKERS / "process_sets.py"), [framework, mode], launcher, framework,
                 tmp_path_factory.mktemp("sets"))
    return with_reports(job)


def test_collectives_stay_within_the_set(sets_job):
    for r in sets_job:
        first = r["rank"] < 2
        assert r["set"] == ([0, 1] if first else [2, 3])
        assert (r["set_rank"], r["set_size"]) == (r["rank"] % 2, 2)
        assert r["allreduce_sum"] == (3 if first else 7)
        assert r["allreduce_average"] == ([0.5, 0.5] if first else [2.5, 2.5])
        assert r["allgather"] == r["set"]
        assert r["broadcast_from_set_rank_1"] == (10 if first else 30)  # root_rank counts inside the set
        assert r["broadcast_object"] == {"from": r["set"][0]}
        assert r["allgather_object"] == [f"r{m}" for m in r["set"]]
        assert r["shard"] == list(range(r["rank"] % 2, 10, 2))
        assert r["whole_job_sum"] == 10  # a set of every rank is the whole job
        assert r["in_c"] == (r["rank"] in (1, 2))
        assert r.get("c_sum") == (3 if r["in_c"] else None)  # the overlapping set [1, 2]


def test_two_sets_train_two_models_without_mixing_gradients(sets_job):
    for a, b in (sets_job[:2], sets_job[2:]):
        assert a["digest_before_broadcast"] != b["digest_before_broadcast"]
        assert a["digest_after_broadcast"] == b["digest_after_broadcast"]
        assert a["digest"] == b["digest"], f"replicas of set {a['set']} differ"
    assert sets_job[0]["digest"] != sets_job[2]["digest"], "the two sets ended with the same model"
    for r in sets_job:
        assert r["changed"] > 1e-3
        assert r["vs_single_process"] <= TOLERANCE, f"rank {r['rank']}: gradients mixed beyond its set"


def test_keras_fit_with_callbacks_stays_within_the_set(sets_job):
    for a, b in (sets_job[:2], sets_job[2:]):
        assert a["fit_digest"] == b["fit_digest"], "BroadcastInitialState/DistributedOptimizer(process_set=)"
        assert a["fit_losses"] == b["fit_losses"], "MetricAverage(process_set=) did not average within the set"
    assert sets_job[0]["fit_digest"] != sets_job[2]["fit_digest"]
    assert sets_job[0]["fit_losses"] != sets_job[2]["fit_losses"], "MetricAverage averaged over the whole job"


def test_misusing_process_sets_is_refused_with_the_fix(sets_job):
    for r in sets_job:
        errors, rank = r["errors"], r["rank"]
        other = "[2, 3]" if rank < 2 else "[0, 1]"
        assert errors["foreign_set"] == (
            f"ProcessSetError: hvdp.allreduce(process_set=hvdp.ProcessSet({other})) was called on rank {rank}, "
            "which is not in the set. Only the set's members call its collectives: guard with ps.included(), "
            "or take this rank's set with hvdp.my_process_set(sets).")
        if rank in (1, 2):
            assert errors["overlapping_sets"].startswith(f"ProcessSetError: Rank {rank} is in 2 of the process sets")
            assert "they overlap" in errors["overlapping_sets"]
        else:
            assert errors["overlapping_sets"] == "no error"  # ranks 0 and 3 are in one set only
        assert "hvdp.ProcessSet([0, 2])): the set is not registered" in errors["unregistered_set"]
        assert errors["ranks_not_a_set"].startswith("TypeError: hvdp.barrier(process_set=...) takes an hvdp.ProcessSet")
        assert "root_rank=2 is not a rank of" in errors["root_outside_set"]
        assert "root_rank counts in the set, 0..1" in errors["root_outside_set"]
        assert f".rank() was called on rank {rank}, which is not in the set" in errors["set_rank_of_non_member"]
        assert "names rank(s) [4], but the job has 4 processes" in errors["rank_outside_job"]
        assert "the set is already registered" in errors["add_twice"]
        if r["mode"] == "static":
            assert "initialize with hvdp.init(process_sets='dynamic')" in errors["add_without_dynamic"]
            assert errors["remove_static"].startswith("ProcessSetError: hvdp.remove_process_set(hvdp.ProcessSet([0, 1")
            assert "initialize with hvdp.init(process_sets='dynamic')" in errors["remove_static"]
        else:
            assert "a set with these ranks is already registered" in errors["add_existing_ranks"]
            removed, ends = r["removed"], rank in (0, 3)
            assert (removed["sum"], removed["sum_again"]) == ((5, 5) if ends else (None, None)), removed
            assert "the set is not registered with the running job" in removed["use_after"]
            assert removed["remove_twice"].startswith("ProcessSetError: hvdp.remove_process_set(hvdp.ProcessSet([0, 3]")
            assert "never added, or removed already" in removed["remove_twice"]
        assert r["after_errors"] == 4, "the job did not survive the refused calls"


# --- partitions of the job, in the same jobs ----------------------------------------------------


@pytest.mark.parametrize("partition, expected", [
    ("two", [[0, 1], [2, 3]]), ("three", [[0, 2], [1], [3]]), ("three_and_one", [[0], [1, 2, 3]])])
def test_each_set_of_a_partition_trains_like_one_process_on_its_members_data(sets_job, partition, expected):
    reports = {r["rank"]: r["partitions"][partition] for r in sets_job}
    assert sorted({tuple(r["set"]) for r in reports.values()}) == [tuple(s) for s in expected]
    for members in expected:
        got = [reports[m] for m in members]
        if len(members) > 1:
            assert len({g["digest_before_broadcast"] for g in got}) == len(members), "members did not start different"
        assert len({g["digest_after_broadcast"] for g in got}) == 1, f"broadcast_state within {members} failed"
        assert len({g["digest"] for g in got}) == 1, f"replicas of set {members} differ"
        for g in got:
            assert g["changed"] > 1e-3
            assert g["vs_single_process"] <= TOLERANCE, f"set {members}: {g['vs_single_process']} from one process"
        sharded = [g["sharded"] for g in got if "sharded" in g]  # torch: Adam's state sharded over the set
        if sharded:
            assert len({s["digest"] for s in sharded}) == 1, f"sharded replicas of set {members} differ"
            whole = 2 * (8 * 16 + 16 + 16 * 3 + 3)  # Adam's two moments of the model (workers/_train.py)
            assert sum(s["state_elements"] for s in sharded) == whole, sharded
            for s in sharded:
                assert s["vs_single_process"] <= TOLERANCE, f"sharded in {members}: {s['vs_single_process']}"
                assert abs(s["state_elements"] - whole / len(members)) <= 4 and s["whole_steps"] == [5], s


def test_batch_norm_buffers_come_from_the_sets_first_member(sets_job):
    for r in sets_job:
        if "buffers" in r:  # torch: set [2, 3] takes rank 2's, not rank 0's (which is not a member)
            assert r["buffers"] == [float(r["set"][0])] * 4, r["buffers"]


# --- examples/ensemble.py ----------------------------------------------------------------------

ENSEMBLE_RUNS = [("torch", "hvdp-run-gloo"), ("tensorflow", "mpirun")]
SET_LINE = re.compile(r"set (\d) \(ranks \[([\d, ]+)\], hidden (\d+)\): test accuracy ([0-9.]+) "
                      r"\((\d+)/(\d+), (\w+), 2 processes")


@pytest.mark.parametrize("framework, launcher", ENSEMBLE_RUNS, ids=["-".join(p) for p in ENSEMBLE_RUNS])
def test_ensemble_example_trains_one_model_per_set(framework, launcher, tmp_path):
    args = ["--framework", framework] if launcher == "mpirun" else []
    job = launch(str(REPO / "examples" / "ensemble.py"), args, launcher, framework, tmp_path)
    found = SET_LINE.findall(job.output)
    assert sorted((s, ranks) for s, ranks, *_ in found) == [("0", "0, 1"), ("1", "2, 3")], job.output[-3000:]
    for _, _, _, accuracy, _, total, reported in found:
        assert float(accuracy) >= 0.9 and int(total) == 360 and reported == framework
    assert {hidden for _, _, hidden, *_ in found} == {"64", "128"}, "the two sets trained the same model"
    ensemble = re.findall(r"ensemble of 2 models: test accuracy ([0-9.]+)", job.output)
    assert len(ensemble) == 1 and float(ensemble[0]) >= 0.9

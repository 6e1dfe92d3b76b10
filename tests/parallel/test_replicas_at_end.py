"""No job ends as a success with its replicas apart, whatever the drift guard's interval (np=2, Gloo):
replicas that part between two checks are refused before ``hvdp.save_checkpoint`` writes (on every
rank; the job goes on) and fail the job at its end, naming the difference
(tests/parallel/workers/replicas_at_end.py; Keras ``fit``: tests/parallel/test_keras_peers.py)."""

from __future__ import annotations

import pytest
from harness import WORKERS, run_job, side_by_side

FRAMEWORKS = ("torch", "tensorflow")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    futures = side_by_side({framework: (lambda f=framework: run_job(
        ["--gloo", "--framework", f, str(WORKERS / "replicas_at_end.py")], tmp_path_factory.mktemp(f"end-{f}")))
        for framework in FRAMEWORKS})
    return {framework: future.result() for framework, future in futures.items()}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_checkpoint_of_replicas_apart_is_refused_on_every_rank(jobs, framework):
    job = jobs[framework]
    assert [r["rank"] for r in job.ranks] == [0, 1], job.why()
    for report in job.ranks:
        assert report["refused"].startswith("ReplicaMismatchError: Replicas drifted apart by step 30 (before "
                                            "saving "), report["refused"]
        assert report["saved"] == "no error" and report["written"]  # equal again: saved


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_job_whose_replicas_part_after_the_last_check_fails_at_its_end(jobs, framework):
    job = jobs[framework]
    assert job.returncode != 0, job.why()
    assert "hvdp: the job failed: rank 1 raised ReplicaMismatchError: Replicas drifted apart by step 60 (at the " \
           "end of the job): compared with rank 0, rank 1 (1 of 2 parameters differ" in job.output \
        or "hvdp: the job failed: rank 0 raised ReplicaMismatchError: Replicas drifted apart by step 60 (at the " \
           "end of the job)" in job.output, job.why()

"""A rank that leaves training while the others still train ends the job within seconds, naming it and the
cause, instead of the stall timeout (np=2, Gloo; --stall-timeout 120, so a stall would show): a tape loop on
TensorFlow's direct gradient path whose rank 1 finishes its script early, and model.fit called on rank 0 alone
(either Keras backend). Keras fit whose ranks would stop at different epochs agree instead
(test_keras_peers.py); a torch loop that leaves early ends naming each rank's step count (test_core.py)."""

from __future__ import annotations

import time

import pytest
from harness import WORKERS, run_job, side_by_side

#: What hvdp run's summary says (either side may say it first: the rank that left, or the one that met it).
CASES = {("tape", "tensorflow"): ("TrainingMismatchError: rank 1 finished its script while ",),
         ("fit", "torch"): ("rank 0 raised TrainingMismatchError: hvdp.allgather_object on rank 0 met a rank that "
                            "has finished its script", "rank 1 raised TrainingMismatchError: rank 1 finished its "
                            "script while rank 0 still called hvdp.allgather_object"),
         ("fit", "tensorflow"): ("rank 0 raised TrainingMismatchError: hvdp.allgather_object on rank 0 met a rank "
                                 "that has finished its script",)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    def run(mode, framework):
        out = tmp_path_factory.mktemp(f"{mode}_{framework}")
        job = run_job(["--gloo", "--framework", framework, "--stall-timeout", "120", str(WORKERS / "leave_early.py"),
                       mode], out, timeout=240)
        return job, time.time() - float((out / "left1").read_text())

    futures = side_by_side({case: (lambda c=case: run(*c)) for case in CASES})
    return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(c))
def test_a_rank_that_leaves_early_is_named_within_seconds(jobs, case):
    job, after_leaving = jobs[case]
    assert job.returncode != 0, job.why()
    summary = next((line for line in job.output.splitlines() if line.startswith("hvdp: the job failed: rank")), "")
    assert any(said in summary for said in CASES[case]), job.why()
    assert after_leaving < 30, after_leaving  # from rank 1's end to the job's: not the 120 s stall timeout

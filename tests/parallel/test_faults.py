"""A failing rank ends the whole job quickly, and hvdp run names it (np=2)."""

from __future__ import annotations

import time

import pytest
from harness import WORKERS, run_job


def run_fault(mode, controller, tmp_path, *extra):
    job = run_job([f"--{controller}", "--framework", "torch", *extra, str(WORKERS / "faults.py"), mode], tmp_path,
                  timeout=240)
    ended = time.time()
    detection = ended - float((tmp_path / "fault_time").read_text())
    return job, detection


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_kill_9_of_one_rank_ends_the_job_within_60_s_naming_it(controller, tmp_path):
    job, detection = run_fault("kill9", controller, tmp_path)
    assert job.returncode != 0
    assert detection < 60, detection
    assert "hvdp: the job failed: rank 1 was killed by SIGKILL" in job.output, job.output[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_an_exception_on_one_rank_is_named_as_the_cause(controller, tmp_path):
    job, detection = run_fault("raise", controller, tmp_path)
    assert job.returncode != 0 and detection < 60
    assert "rank 1 raised RuntimeError: injected failure at step 5" in job.output, job.output[-3000:]
    assert "rank 0 raised" not in job.output  # rank 0 only stopped because rank 1 failed


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_stalled_rank_ends_the_job_after_the_stall_timeout_naming_rank_and_tensors(controller, tmp_path):
    job, detection = run_fault("stall", controller, tmp_path, "--stall-timeout", "10")
    assert job.returncode != 0
    assert 10 <= detection < 10 + 20, detection  # Horovod checks every timeout/5 s, then the launcher stops
    assert "hvdp: the job was ended: rank 1 never submitted allreduce." in job.output, job.output[-3000:]

"""Checkpoints in real 2-process jobs: a crashed run resumes from its last checkpoint and ends
exactly where an uninterrupted run ends; bad checkpoints fail clearly on every rank."""

from __future__ import annotations

import shutil

import pytest
from harness import WORKERS, run_job

FRAMEWORKS = ["torch", "tensorflow"]


def run(framework, mode, folder):
    """One job; where it succeeded, every rank must have reported (a job of one rank's report proves nothing
    of the other)."""
    job = run_job(["--gloo", "--framework", framework, str(WORKERS / "checkpoint_resume.py"), mode], folder)
    if job.returncode == 0:
        assert [r["rank"] for r in job.ranks] == [0, 1], f"missing rank reports:\n{job.output[-4000:]}"
    return job


_FULL: dict = {}


def full_run(framework, tmp_path_factory):
    """The uninterrupted run of ``framework`` (its folder holds its checkpoints), once per module."""
    if framework not in _FULL:
        folder = tmp_path_factory.mktemp(f"full-{framework}")
        _FULL[framework] = (run(framework, "full", folder), folder)
    return _FULL[framework]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_crash_at_step_7_resumes_from_step_5_and_ends_like_an_uninterrupted_run(framework, tmp_path,
                                                                                tmp_path_factory):
    full, _ = full_run(framework, tmp_path_factory)
    assert full.returncode == 0, full.output[-4000:]
    assert len({r["final"] for r in full.ranks}) == 1

    crashed = tmp_path / "crashed"
    failed = run(framework, "crash", crashed)
    assert failed.returncode != 0 and "rank 1 raised RuntimeError: injected crash at step 7" in failed.output
    assert (crashed / "step5.npz").exists() and not (crashed / "step10.npz").exists()
    for leftover in crashed.glob("rank*.json"):
        leftover.unlink()

    resumed = run(framework, "resume", crashed)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert [r["extras"] for r in resumed.ranks] == [{"step": 5, "note": "digits"}] * 2
    assert {r["final"] for r in resumed.ranks} == {full.ranks[0]["final"]}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_checkpoints_raise_clear_errors_on_every_rank(framework, tmp_path, tmp_path_factory):
    other = "tensorflow" if framework == "torch" else "torch"
    made, folder = full_run(other, tmp_path_factory)  # the other framework's uninterrupted run
    assert made.returncode == 0, made.output[-4000:]
    (tmp_path / "bad").mkdir()
    shutil.copy(folder / "step5.npz", tmp_path / "bad" / "other_framework.npz")
    job = run(framework, "errors", tmp_path / "bad")
    assert job.returncode == 0, job.output[-4000:]
    for rank in job.ranks:
        errors = rank["errors"]
        assert "nope.npz does not exist" in errors["missing"]
        assert "truncated.npz is corrupt or truncated" in errors["truncated"]
        assert "does not match the model" in errors["architecture"] and "different shapes" in errors["architecture"]
        assert f"written by a {other} job; this job runs {framework}" in errors["other_framework"]
        assert errors["job_still_works"] == 2.0
    assert job.ranks[0]["errors"] == job.ranks[1]["errors"]

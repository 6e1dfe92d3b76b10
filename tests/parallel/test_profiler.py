"""hvdp run --profile + hvdp report on real 2-process jobs: the report names the straggler and why.

Rank 1 is made a straggler by a 150 ms sleep in its data phase (input skew) or by 150 ms
of extra matrix products in its compute phase (compute skew); a balanced run names no one
(test_profiler_balanced.py, run with no other test beside it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import REPO, WORKERS, run_job

DELAY = 0.15


def profile(framework, mode, tmp_path):
    directory = tmp_path / "profile"
    job = run_job(["--gloo", "--framework", framework, "--profile", str(directory),
                   str(WORKERS / f"profile_{framework}.py"), mode], tmp_path)
    assert job.returncode == 0, job.output[-5000:]
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "report", str(directory), "--json"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    return data


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_input_skew_names_rank_1_and_rank_0_waits_in_sync(framework, tmp_path):
    data = profile(framework, "input_skew", tmp_path)
    assert data["diagnosis"]["verdict"] == "input skew", data["diagnosis"]
    assert data["diagnosis"]["stragglers"] == [1]
    rank0 = data["ranks"][0]
    assert rank0["phases"]["sync"] >= 0.8 * DELAY, rank0


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_compute_skew_names_rank_1(framework, tmp_path):
    data = profile(framework, "compute_skew", tmp_path)
    assert data["diagnosis"]["verdict"] == "compute skew", data["diagnosis"]
    assert data["diagnosis"]["stragglers"] == [1]

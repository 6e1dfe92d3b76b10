"""hvdp report on a balanced 2-process job names no straggler.

The report names a rank whose median data + compute time passes the fastest rank's by 10% of the step: what a
rank that shares its core with another job's process does. ``make test`` runs this file with no other test
beside it (tests/conftest.py's ``ALONE_FILES``): beside the other lane's jobs, rank 1's median compute once
passed rank 0's by more than that (4.9 ms of a 48.6 ms step) and the report named it, rightly."""

from __future__ import annotations

import pytest
from test_profiler import profile


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_balanced_run_names_no_straggler(framework, tmp_path):
    data = profile(framework, "balanced", tmp_path)
    assert data["diagnosis"]["stragglers"] == [], data["diagnosis"]
    assert data["diagnosis"]["verdict"] in ("balanced", "synchronization")

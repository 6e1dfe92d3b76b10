"""examples/train_digits.py under hvdp run -np 2: the same script on both frameworks."""

from __future__ import annotations

import re

import pytest
from harness import REPO, run_job


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_train_digits_reaches_95_percent(framework, tmp_path):
    job = run_job(["--framework", framework, str(REPO / "examples" / "train_digits.py")], tmp_path)
    assert job.returncode == 0, job.output[-6000:]
    assert f"hvdp: {framework} on 2 processes" in job.output
    assert len(re.findall(r"epoch +\d+/20 +loss", job.output)) == 20  # printed once, by rank 0
    found = re.findall(r"test accuracy: ([0-9.]+) \((\d+)/(\d+), (\w+), 2 processes", job.output)
    assert len(found) == 1, job.output[-3000:]
    accuracy, correct, total, name = found[0]
    assert name == framework and int(total) == 360
    assert float(accuracy) >= 0.95

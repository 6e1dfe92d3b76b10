"""The examples under hvdp run -np 2: the same script on both frameworks, chosen only by the flag."""

from __future__ import annotations

import re

import pytest
from harness import REPO, run_job

FRAMEWORKS = ["torch", "tensorflow"]
_RUNS: dict = {}


def example(script, framework, tmp_path_factory):
    """Run examples/SCRIPT once per framework; return (output, accuracy, framework reported)."""
    if (script, framework) not in _RUNS:
        out = tmp_path_factory.mktemp("ex")
        job = run_job(["--framework", framework, "--profile", str(out / "profile"), str(REPO / "examples" / script)],
                      out)
        assert job.returncode == 0, job.output[-6000:]
        found = re.findall(r"test accuracy: ([0-9.]+) \((\d+)/(\d+), (\w+), 2 processes", job.output)
        assert len(found) == 1, job.output[-3000:]  # printed once, by rank 0
        accuracy, _, total, reported = found[0]
        assert int(total) == 360
        _RUNS[script, framework] = (job.output, float(accuracy), reported, out / "profile")
    return _RUNS[script, framework]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_train_digits_reaches_95_percent(framework, tmp_path_factory):
    output, accuracy, reported, _ = example("train_digits.py", framework, tmp_path_factory)
    assert f"hvdp: {framework} on 2 processes" in output
    assert len(re.findall(r"epoch +\d+/20 +loss", output)) == 20
    assert reported == framework and accuracy >= 0.95


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_keras_digits_reaches_95_percent_on_the_flagged_backend(framework, tmp_path_factory):
    output, accuracy, reported, _ = example("keras_digits.py", framework, tmp_path_factory)
    assert f"on {framework}, 2 processes" in output
    assert len(re.findall(r"epoch +\d+/20 +loss [0-9.]+ +accuracy", output)) == 20
    assert reported == framework and accuracy >= 0.95


def test_keras_digits_accuracies_of_the_two_frameworks_agree(tmp_path_factory):
    accuracies = [example("keras_digits.py", framework, tmp_path_factory)[1] for framework in FRAMEWORKS]
    assert abs(accuracies[0] - accuracies[1]) <= 0.02, accuracies


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_train_digits_records_every_step_under_profile(framework, tmp_path_factory):
    from hvdp import report

    profile = example("train_digits.py", framework, tmp_path_factory)[3]
    records = report.load(profile)
    assert sorted(records) == [0, 1] and all(len(steps) == 20 * 23 for steps in records.values())
    assert all(step["phases"].get("sync", 0) > 0 and step["examples"] for step in records[0][1:])
    summaries = report.summarize(records)
    assert report.diagnose(summaries).stragglers == []


def test_timeline_flag_writes_horovods_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    job = run_job(["--framework", "torch", "--timeline", str(timeline), str(REPO / "examples" / "train_digits.py"),
                   "--epochs", "1"], tmp_path)
    assert job.returncode == 0, job.output[-3000:]
    text = timeline.read_text()
    assert text.startswith("[") and '"ph": "M"' in text and "ALLREDUCE" in text

"""hvdp report on recorded step files: loading, medians, the diagnosis, errors, the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvdp import report


def write_run(directory, per_rank_phases, steps=20, examples=32):
    """Write rank<N>.jsonl as hvdp.profiler does, each step with the given phases (seconds)."""
    directory.mkdir(exist_ok=True)
    for rank, phases in per_rank_phases.items():
        total = max(sum(p.values()) for p in per_rank_phases.values()) + 0.001
        with open(directory / f"rank{rank}.jsonl", "w") as out:
            for step in range(steps):
                out.write(json.dumps({"step": step, "time": 0.0, "seconds": total, "phases": phases,
                                      "examples": examples}) + "\n")
    return directory


def verdict(directory):
    return report.diagnose(report.summarize(report.load(directory)))


def test_input_skew_names_the_slow_rank(tmp_path):
    run = write_run(tmp_path / "p", {0: {"data": 0.001, "compute": 0.010, "sync": 0.101},
                                     1: {"data": 0.101, "compute": 0.010, "sync": 0.001}})
    found = verdict(run)
    assert (found.verdict, found.stragglers) == ("input skew", [1])
    assert "rank 1 is the straggler" in found.explanation and "101.0 ms in data" in found.explanation
    assert found.numbers["others_sync_seconds"] == pytest.approx(0.101)


def test_compute_skew_names_the_slow_rank(tmp_path):
    run = write_run(tmp_path / "p", {0: {"data": 0.001, "compute": 0.090, "sync": 0.001},
                                     1: {"data": 0.001, "compute": 0.010, "sync": 0.081},
                                     2: {"data": 0.001, "compute": 0.011, "sync": 0.080}})
    found = verdict(run)
    assert (found.verdict, found.stragglers) == ("compute skew", [0])


def test_balanced_and_synchronization_bound_runs_name_no_straggler(tmp_path):
    balanced = verdict(write_run(tmp_path / "a", {0: {"data": 0.002, "compute": 0.020, "sync": 0.002},
                                                  1: {"data": 0.002, "compute": 0.021, "sync": 0.002}}))
    assert (balanced.verdict, balanced.stragglers) == ("balanced", [])
    bound = verdict(write_run(tmp_path / "b", {0: {"data": 0.001, "compute": 0.010, "sync": 0.040},
                                               1: {"data": 0.001, "compute": 0.010, "sync": 0.040}}))
    assert (bound.verdict, bound.stragglers) == ("synchronization", [])


def test_summary_skips_warm_up_and_computes_throughput(tmp_path):
    run = write_run(tmp_path / "p", {0: {"data": 0.001, "compute": 0.009}}, steps=10, examples=64)
    lines = (run / "rank0.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["seconds"] = 5.0  # a slow first step (tracing, warm-up) must not count
    (run / "rank0.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    (summary,) = report.summarize(report.load(run))
    assert summary.steps == 9 and summary.step_seconds == pytest.approx(0.011)
    assert summary.examples_per_second == pytest.approx(64 / 0.011)


@pytest.mark.parametrize("content, message", [(None, "no rank\\*.jsonl files"), ("not json\n", "rank0.jsonl:1 is not"),
                                              ('{"step": 0}\n', "rank0.jsonl:1 is not")])
def test_bad_directories_and_files_are_named(tmp_path, content, message):
    if content is not None:
        (tmp_path / "rank0.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        report.load(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        report.load(tmp_path / "missing")


def test_cli_prints_json_and_draws_the_plot(tmp_path):
    run = write_run(tmp_path / "p", {0: {"data": 0.001, "compute": 0.010, "sync": 0.101},
                                     1: {"data": 0.101, "compute": 0.010, "sync": 0.001}})
    png = tmp_path / "report.png"
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "report", str(run), "--json", "--plot", str(png)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["diagnosis"]["verdict"] == "input skew" and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    missing = subprocess.run([sys.executable, "-m", "hvdp.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr

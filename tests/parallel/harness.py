"""Run a worker script under `hvdp run` (hence horovodrun) and collect what every rank reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
HVDP = [sys.executable, "-m", "hvdp.cli"]
#: A job that does not finish in this time has hung: the test fails, it does not wait forever.
TIMEOUT_S = 420


@dataclass
class Job:
    """A finished job: its exit code, output, and one record per rank."""

    returncode: int
    output: str
    ranks: List[Dict]


def run_job(args: List[str], out_dir: Path, np_: int = 2, timeout: int = TIMEOUT_S) -> Job:
    """`hvdp run -np N ARGS...`, with HVDP_TEST_OUT=out_dir for the workers' reports."""
    env = {**os.environ, "HVDP_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("HVDP_FRAMEWORK", None)
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.run([*HVDP, "run", "-np", str(np_), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    output = proc.stdout + proc.stderr
    ranks = []
    for rank in range(np_):
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    return Job(proc.returncode, output, ranks)


def run_worker(worker: str, controller: str, framework: str, out_dir: Path, np_: int = 2) -> Job:
    """Run tests/parallel/workers/WORKER on np_ processes and require every rank's report."""
    job = run_job([f"--{controller}", "--framework", framework, str(WORKERS / worker)], out_dir, np_)
    assert job.returncode == 0, f"{worker} ({controller}, {framework}) exited {job.returncode}:\n{job.output[-6000:]}"
    assert [r["rank"] for r in job.ranks] == list(range(np_)), f"missing rank reports:\n{job.output[-4000:]}"
    return job


def max_abs_diff(a: List[float], b: List[float]) -> float:
    """Largest elementwise difference of two equal-length vectors."""
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)

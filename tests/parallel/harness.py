"""Run a worker script under `hvdp run` (hence horovodrun) and collect what every rank reports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional, TypeVar

K = TypeVar("K", bound=Hashable)

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
HVDP = [sys.executable, "-m", "hvdp.cli"]
#: A line of a job's output that says what went wrong: an error Horovod logged (``[1] [2026-12-02
#: 18:44:49.081: E .../operations.cc:697] ...``), hvdp's summary of a failed job, a Python exception.
ERROR_LINE = re.compile(r"\d: E |^hvdp: |^(\[\d+\] )?[\w.]*(Error|Exception)\b")
#: A job that does not finish in this time has hung: the test fails, it does not wait forever.
TIMEOUT_S = 420


@dataclass
class Job:
    """A finished job: its exit code, output, and one record per rank."""

    returncode: int
    output: str
    ranks: List[Dict]

    def why(self, tail: int = 4000) -> str:
        """For a failure's message: the lines that say what went wrong, wherever they are (a rank's
        logged Horovod error, hvdp's summary, an exception), then the last ``tail`` characters."""
        marked = [line for line in self.output.splitlines() if ERROR_LINE.search(line)][:20]
        head = "the lines that say why:\n" + "\n".join(marked) + "\n\n" if marked else ""
        return f"{head}the output's end:\n{self.output[-tail:]}"


def run_job(args: List[str], out_dir: Path, np_: int = 2, timeout: int = TIMEOUT_S,
            extra_env: Optional[Dict[str, str]] = None) -> Job:
    """`hvdp run -np N ARGS...`, with HVDP_TEST_OUT=out_dir for the workers' reports (and ``extra_env``)."""
    env = {**os.environ, "HVDP_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", **(extra_env or {})}
    env.pop("HVDP_FRAMEWORK", None)
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.Popen([*HVDP, "run", "-np", str(np_), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = communicate(proc, timeout, f"hvdp run {' '.join(args)}")
    ranks = []
    for rank in range(np_):
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    return Job(proc.returncode, output, ranks)


#: Plain `mpirun`, as HPC users start MPI programs: as root, and 4 processes on 2 cores.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
#: One thread per process: mpirun does not set them as `hvdp run` does.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def run_mpirun(args: List[str], out_dir: Path, np_: int = 4, timeout: int = 300) -> Job:
    """`mpirun -np N python ARGS...` with HVDP_TEST_OUT=out_dir; the whole job is killed if it hangs."""
    env = {**os.environ, **ONE_THREAD, "HVDP_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND"):
        env.pop(var, None)
    proc = subprocess.Popen([*MPIRUN, "-np", str(np_), sys.executable, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = communicate(proc, timeout, f"mpirun {' '.join(args)}")
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(np_)
             if (out_dir / f"rank{r}.json").exists()]
    return Job(proc.returncode, output, ranks)


def communicate(proc: "subprocess.Popen[str]", timeout: float, what: str) -> str:
    """``proc``'s output (started with start_new_session); past ``timeout``, end its whole process group
    (SIGTERM, which launchers pass to their ranks, then SIGKILL) and fail naming ``what`` hung."""
    try:
        output, _ = proc.communicate(timeout=timeout)
        return str(output)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        raise AssertionError(f"{what} hung for {timeout} s:\n{output[-4000:]}") from None


def side_by_side(jobs: Dict[K, Callable[[], object]]) -> Dict[K, "Future[object]"]:
    """Jobs that spend most of their time waiting (a stall timeout, an elastic cooldown, a heartbeat's
    silence), run at once, one thread each, all finished on return; a test reads its own with
    ``.result()``, which raises that job's error.

    For jobs whose checks time only what happens after the job is up (from a fault to the end, say):
    their start-ups share the cores, their waits overlap.
    """
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return {key: pool.submit(job) for key, job in jobs.items()}


def run_worker(worker: str, controller: str, framework: str, out_dir: Path, np_: int = 2,
               extra_env: Optional[Dict[str, str]] = None) -> Job:
    """Run tests/parallel/workers/WORKER on np_ processes and require every rank's report."""
    job = run_job([f"--{controller}", "--framework", framework, str(WORKERS / worker)], out_dir, np_,
                  extra_env=extra_env)
    assert job.returncode == 0, f"{worker} ({controller}, {framework}) exited {job.returncode}:\n{job.output[-6000:]}"
    assert [r["rank"] for r in job.ranks] == list(range(np_)), f"missing rank reports:\n{job.output[-4000:]}"
    return job


def max_abs_diff(a: List[float], b: List[float]) -> float:
    """Largest elementwise difference of two equal-length vectors."""
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)

"""How hvdp bench runs a contender: the command and environment of each job, started in turn, round after round
(``--smoke``, which measures nothing, runs two jobs at a time)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import psutil  # type: ignore[import-untyped]

from hvdp.bench.plan import Contender, Group, Settings
from hvdp.bench.stats import median
from hvdp.errors import BenchError
from hvdp.frameworks import SPECS

#: Thread variables every contender gets (the same as hvdp's launcher sets).
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


#: Seconds one contender's job may take before the bench gives up on it.
JOB_TIMEOUT_S = 600
#: The same for a ``--smoke`` job, which takes 5 to 20 s: a job that hangs costs minutes, not ten.
SMOKE_JOB_TIMEOUT_S = 180
#: Seconds a job past its time gets to print its Python stacks (faulthandler, on SIGABRT) before SIGKILL.
STACKS_GRACE_S = 5
#: Jobs a ``--smoke`` run keeps going at once: its figures mean nothing (3 steps), and most of a job is its
#: processes importing torch or TensorFlow, so two overlap their start-ups and waits.
SMOKE_JOBS_AT_ONCE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hvdp_env(contender: Contender, environ: Mapping[str, str], cpu_count: int) -> Tuple[List[str], Dict[str, str]]:
    """hvdp's own horovodrun command and environment for a worker (hvdp's defaults included)."""
    from hvdp import launch

    args = launch.parse_run_args(["-np", str(contender.np), f"--{contender.controller}",
                                  "--framework", contender.framework, sys.executable, "-m", "hvdp.bench.worker"],
                                 arity={})
    return launch.build_command(args, environ, cpu_count, launch.horovodrun_path())


def job(contender: Contender, settings: Settings, out: str, environ: Mapping[str, str],
        cpu_count: int) -> Tuple[List[List[str]], Dict[str, str], List[Dict[str, str]]]:
    """The command(s) and environment starting ``contender``: (argvs, common env, per-process env).

    One argv for launchers (hvdp run, horovodrun, torchrun); one per process for
    MultiWorkerMirroredStrategy, each with its TF_CONFIG.
    """
    base = dict(environ)
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND"):
        base.pop(var, None)
    base.update(contender.env)
    if contender.knobs == "one-thread":
        base.update({var: "1" for var in THREAD_VARS})
    hvdp_argv, hvdp_set = hvdp_env(contender, base, cpu_count)
    if contender.knobs == "threads":
        knobs = {var: hvdp_set[var] for var in THREAD_VARS if var in hvdp_set}
    else:
        knobs = dict(hvdp_set)
    for var, value in SPECS[contender.framework].bench_env:
        knobs.setdefault(var, value)
    worker = ["--impl", contender.impl, "--framework", contender.framework, "--model", contender.model,
              "--batch", str(settings.batch), "--warmup", str(settings.warmup), "--steps", str(settings.steps),
              "--out", out]
    if contender.optimizer != "sgd" or contender.shard:
        worker += ["--optimizer", contender.optimizer] + (["--shard"] if contender.shard else [])
    if contender.task == "allreduce":
        worker = ["--impl", contender.impl, "--sizes", ",".join(map(str, settings.sweep_bytes)),
                  "--budget", str(settings.allreduce_budget), "--form", contender.form, "--out", out]
    if contender.task == "breakdown":
        worker = ["--impl", contender.impl, "--sizes", ",".join(map(str, settings.breakdown_bytes)),
                  "--calls", str(settings.breakdown_calls), "--warmup", str(min(settings.warmup, 2)),
                  "--budget", str(settings.breakdown_budget), "--out", out]
    worker = [contender.task, *worker]
    python = [sys.executable, "-m", "hvdp.bench.worker"]
    env = {**base, **knobs, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    if contender.impl == "hvdp":
        return [hvdp_argv + worker], env, []
    if contender.impl in ("horovod", "mpi4py"):
        from hvdp import launch

        argv = [launch.horovodrun_path(), "-np", str(contender.np), f"--{contender.controller}", *python, *worker]
        return [argv], env, []
    if contender.impl in ("ddp", "torchdist"):
        # --standalone: torchrun binds its store on a free port itself; a port chosen here and released could
        # be taken by another job's process in between (a smoke run starts two jobs at a time).
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(contender.np), "-m", "hvdp.bench.worker", *worker]
        return [argv], env, []
    if contender.impl == "mwms":
        ports = [_free_port() for _ in range(contender.np)]
        cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
        per = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
               for i in range(contender.np)]
        return [python + worker for _ in range(contender.np)], env, per
    raise BenchError(f"unknown contender implementation {contender.impl!r}.")


def run_contender(contender: Contender, settings: Settings, workdir: Path, environ: Mapping[str, str],
                  cpu_count: int) -> dict:
    """Start ``contender``'s job, wait for it, and return rank 0's record."""
    name = uuid.uuid4().hex  # jobs may run side by side (--smoke)
    out = workdir / f"result-{name}.json"
    argvs, env, per = job(contender, settings, str(out), environ, cpu_count)
    log = workdir / f"job-{name}.log"
    limit = SMOKE_JOB_TIMEOUT_S if settings.mode == "smoke" else JOB_TIMEOUT_S
    with open(log, "w") as handle:
        procs = [subprocess.Popen(argv, env={**env, **(per[i] if per else {})}, stdout=handle,
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for i, argv in enumerate(argvs)]
        codes = wait_all(procs, limit)
    if any(code is None for code in codes):
        raise BenchError(f"{contender.label}: the job was still running after {limit} s, so it was stopped "
                         f"(its processes' Python stacks are at the end of its output). "
                         f"Command: {' '.join(argvs[0])}\nLast output:\n{_tail(log)}")
    if any(codes) or not out.exists():
        raise BenchError(f"{contender.label}: the job exited with {codes} and wrote no result. "
                         f"Command: {' '.join(argvs[0])}\nLast output:\n{_tail(log)}")
    record: dict = json.loads(out.read_text())
    out.unlink()
    log.unlink()
    return record


def wait_all(procs: List["subprocess.Popen[bytes]"], limit: float) -> List[Optional[int]]:
    """Each process's exit code, or None for one still running after ``limit`` seconds: that one and every
    process below it (a launcher's workers may have sessions of their own) are sent SIGABRT, so Python
    processes run with PYTHONFAULTHANDLER print their stacks, then SIGKILL."""
    deadline = time.monotonic() + limit
    codes: List[Optional[int]] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    late = [proc for proc in procs if proc.poll() is None]
    tree = [p for proc in late for p in _tree(proc.pid)]
    _send(tree, signal.SIGABRT)
    psutil.wait_procs(tree, timeout=STACKS_GRACE_S)
    _send(tree, signal.SIGKILL)
    for proc in late:
        proc.wait()
    return codes


def _tree(pid: int) -> List["psutil.Process"]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def _send(processes: List["psutil.Process"], sig: int) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:  # it has gone
            pass


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def run_groups(groups: List[Group], settings: Settings, environ: Mapping[str, str], cpu_count: int,
               progress: Callable[[str], None],
               runner: Callable[[Contender, Settings, Path, Mapping[str, str], int], dict] = run_contender) -> None:
    """Run each group's contenders in turn, ``settings.rounds`` times (A B C A B C ...); a smoke run keeps
    SMOKE_JOBS_AT_ONCE jobs going at once, and records them in the same order."""
    runs = [(group, r, contender) for group in groups for r in range(group.rounds or settings.rounds)
            for contender in group.contenders]
    with tempfile.TemporaryDirectory(prefix="hvdp-bench-") as tmp:

        def one(item: Tuple[Group, int, Contender]) -> dict:
            group, r, contender = item
            start = time.monotonic()
            try:
                record = runner(contender, settings, Path(tmp), environ, cpu_count)
            except BenchError as exc:
                # A smoke run proves that each contender runs: one that hung (its stacks printed here) gets
                # one more start; a second hang fails the run. Measuring runs never retry.
                if settings.mode != "smoke" or "still running after" not in str(exc):
                    raise
                progress(f"[{group.name}] {exc}\n[{group.name}] {contender.label}: hung; starting it once more")
                record = runner(contender, settings, Path(tmp), environ, cpu_count)
            progress(f"[{group.name}] round {r + 1}/{group.rounds or settings.rounds}  {contender.label:<48} "
                     f"{_brief(record)}  ({time.monotonic() - start:.0f} s)")
            return record

        at_once = SMOKE_JOBS_AT_ONCE if settings.mode == "smoke" else 1
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            for (group, _, contender), record in zip(runs, pool.map(one, runs)):
                group.runs.setdefault(contender.label, []).append(record)


def _brief(record: dict) -> str:
    if "step_seconds" in record:
        cpu = record.get("cpu_seconds_per_step")
        return f"step {median(record['step_seconds']) * 1e3:7.1f} ms" + \
            (f", rank 0 CPU {cpu * 1e3:6.1f} ms/step" if cpu is not None else "")
    if "phases" in record:
        variant = next(iter(record["phases"]))
        cells = []
        for nbytes, by_rank in record["phases"][variant].items():
            rows = by_rank.get("0", [])
            cells.append(f"{int(nbytes) >> 10} KB in {median([r['call'] for r in rows]) / 1e3:.1f} ms"
                         if rows else f"{int(nbytes) >> 10} KB: no calls")
        return f"{variant}: " + ", ".join(cells)
    largest = max(record["seconds"], key=int)
    return f"{int(largest) >> 20} MB in {median(record['seconds'][largest]) * 1e3:.1f} ms"

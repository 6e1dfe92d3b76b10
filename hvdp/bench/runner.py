"""How hvdp bench runs a contender: the command and environment of each job, started one at a time, round after
round, the contenders of each round in a shuffled order (``--smoke``, which measures nothing, runs two jobs at
a time)."""

from __future__ import annotations

import json
import random
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
from hvdp.bench.stats import mean_step, median
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
#: Jobs a ``--smoke`` run keeps going at once: its figures mean nothing (2 steps), and most of a job is its
#: processes importing torch or TensorFlow, then waiting (rendezvous, shutdown): three fill each other's waits.
SMOKE_JOBS_AT_ONCE = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hvdp_env(contender: Contender, environ: Mapping[str, str], cpu_count: int) -> Tuple[List[str], Dict[str, str]]:
    """hvdp run's horovodrun command and the environment it sets for a worker (hvdp's defaults included)."""
    from hvdp import launch

    args = launch.parse_run_args(["-np", str(contender.np), f"--{contender.controller}",
                                  "--framework", contender.framework, sys.executable, "-m", "hvdp.bench.worker"],
                                 arity={})
    return launch.build_command(args, environ, cpu_count, launch.horovodrun_path())


def hvdp_command() -> List[str]:
    """The ``hvdp`` command as users start it: the console script of this Python's environment (else hvdp's
    entry point through this Python)."""
    beside = Path(sys.executable).parent / "hvdp"
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-c", "import sys; from hvdp.launch.run import run; sys.exit(run(sys.argv[2:]))", "run"]


def worker_args(contender: Contender, settings: Settings, out: str) -> List[str]:
    """The words after ``python -m hvdp.bench.worker`` for ``contender``'s task."""
    if contender.task == "allreduce":
        return ["allreduce", "--impl", contender.impl, "--sizes", ",".join(map(str, settings.sweep_bytes)),
                "--budget", str(settings.allreduce_budget), "--form", contender.form, "--out", out]
    if contender.task == "breakdown":
        return ["breakdown", "--impl", contender.impl, "--sizes", ",".join(map(str, settings.breakdown_bytes)),
                "--calls", str(settings.breakdown_calls), "--warmup", str(min(settings.warmup, 2)),
                "--budget", str(settings.breakdown_budget), "--out", out]
    worker = ["train", "--impl", contender.impl, "--framework", contender.framework, "--model", contender.model,
              "--batch", str(settings.batch), "--warmup", str(settings.warmup), "--steps", str(settings.steps),
              "--out", out]
    if contender.optimizer != "sgd" or contender.shard:
        worker += ["--optimizer", contender.optimizer] + (["--shard"] if contender.shard else [])
    return worker


def job(contender: Contender, settings: Settings, out: str, environ: Mapping[str, str],
        cpu_count: int) -> Tuple[List[List[str]], Dict[str, str], List[Dict[str, str]]]:
    """The command(s) and environment starting ``contender``: (argvs, common env, per-process env).

    One argv for launchers (hvdp run, horovodrun, torchrun); one per process for
    MultiWorkerMirroredStrategy, each with its TF_CONFIG. hvdp starts as its users start it, under
    ``hvdp run`` (its per-rank bootstrap, output relay and heartbeat included), which sets its own
    variables; a peer gets none of them (``knobs="defaults"``: as shipped) or all of them (like for like).
    """
    base = dict(environ)
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND"):
        base.pop(var, None)
    for var, value in SPECS[contender.framework].bench_env:  # what the framework's processes need to start
        base.setdefault(var, value)
    base.update(contender.env)
    if contender.knobs == "one-thread":
        base.update({var: "1" for var in THREAD_VARS})
    hvdp_argv, hvdp_set = hvdp_env(contender, base, cpu_count)
    knobs = {} if contender.knobs == "defaults" or contender.impl == "hvdp" else dict(hvdp_set)
    worker = worker_args(contender, settings, out)
    python = [sys.executable, "-m", "hvdp.bench.worker"]
    env = {**base, **knobs, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    if contender.impl == "hvdp":
        run = [*hvdp_command(), "run", *hvdp_argv[1:4], "--framework", contender.framework]
        return [run + python + worker], env, []
    if contender.impl in ("horovod", "mpi4py"):
        from hvdp import launch
        from hvdp.launch.command import in_process

        # horovodrun's own command line, started as hvdp run starts it (python -m hvdp.launch.horovodrun): its
        # build check (5-7 s of importing TensorFlow per launch) answered from a cache; the ranks are the same.
        argv = [launch.horovodrun_path(), "-np", str(contender.np), f"--{contender.controller}", *python, *worker]
        return [in_process(argv)], env, []
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


def describe(contender: Contender, settings: Settings, environ: Mapping[str, str], cpu_count: int) -> dict:
    """What the results file says of ``contender``: its settings, the variables the bench set for it (beyond
    ``environ``), those ``hvdp run`` sets for hvdp's ranks, and its command."""
    argvs, env, _ = job(contender, settings, "OUT.json", environ, cpu_count)
    _, hvdp_set = hvdp_env(contender, env, cpu_count)
    own = {k: v for k, v in env.items() if environ.get(k) != v and k not in ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")}
    return {"impl": contender.impl, "framework": contender.framework, "np": contender.np,
            "controller": contender.controller, "task": contender.task, "model": contender.model,
            "settings": contender.settings, "knobs": contender.knobs, "env": own,
            "set_by_hvdp_run": hvdp_set if contender.impl == "hvdp" else {}, "argv": argvs[0]}


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


def round_orders(contenders: List[Contender], rounds: int, rng: random.Random) -> List[List[Contender]]:
    """The contenders' order in each round: a shuffle drawn from ``rng``, drawn again (a few times at most)
    when it repeats the round before, so that no contender keeps one place in the machine's slow phases.

    Example:
        >>> a, b = Contender("A", "hvdp"), Contender("B", "horovod")
        >>> orders = round_orders([a, b], 3, random.Random(0))
        >>> [[c.label for c in o] for o in orders]
        [['B', 'A'], ['A', 'B'], ['B', 'A']]
    """
    orders: List[List[Contender]] = []
    for _ in range(rounds):
        order = rng.sample(contenders, len(contenders))
        for _ in range(10):
            if not orders or len(contenders) < 2 or order != orders[-1]:
                break
            order = rng.sample(contenders, len(contenders))
        if orders and len(contenders) > 1 and order == orders[-1]:  # ten draws alike (two contenders: 1 in 1024)
            order = order[1:] + order[:1]
        orders.append(order)
    return orders


def run_groups(groups: List[Group], settings: Settings, environ: Mapping[str, str], cpu_count: int,
               progress: Callable[[str], None],
               runner: Callable[[Contender, Settings, Path, Mapping[str, str], int], dict] = run_contender) -> None:
    """Run each group's contenders ``settings.rounds`` times, in a shuffled order per round drawn from
    ``settings.seed`` (``Group.orders``); a smoke run keeps SMOKE_JOBS_AT_ONCE jobs going at once.

    ``Group.runs[label][r]`` is rank 0's record of round ``r``; ``Group.samples`` every job in the order
    started: round, place in the round, the contender, its job's wall seconds and its record."""
    rng = random.Random(settings.seed)
    runs: List[Tuple[Group, int, int, Contender]] = []
    for group in groups:
        group.orders = []
        for r, order in enumerate(round_orders(group.contenders, group.rounds or settings.rounds, rng)):
            group.orders.append([c.label for c in order])
            runs += [(group, r, place, contender) for place, contender in enumerate(order)]
    with tempfile.TemporaryDirectory(prefix="hvdp-bench-") as tmp:

        def one(item: Tuple[Group, int, int, Contender]) -> Tuple[dict, float]:
            group, r, _, contender = item
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
            seconds = time.monotonic() - start
            progress(f"[{group.name}] round {r + 1}/{group.rounds or settings.rounds}  {contender.label:<48} "
                     f"{_brief(record)}  ({seconds:.0f} s)")
            return record, seconds

        at_once = SMOKE_JOBS_AT_ONCE if settings.mode == "smoke" else 1
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            for (group, r, place, contender), (record, seconds) in zip(runs, pool.map(one, runs)):
                group.samples.append({"round": r, "place": place, "contender": contender.label,
                                      "job_seconds": round(seconds, 3), "record": record})
        for group in groups:  # each contender's records in round order
            for label in [c.label for c in group.contenders]:
                group.runs[label] = [s["record"] for s in sorted(group.samples, key=lambda s: s["round"])
                                     if s["contender"] == label]


def _brief(record: dict) -> str:
    if "step_seconds" in record:
        cpu = record.get("cpu_seconds_per_step")
        return f"step {mean_step(record) * 1e3:7.1f} ms" + \
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

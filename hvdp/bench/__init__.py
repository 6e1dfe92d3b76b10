"""``hvdp bench``: hvdp measured side by side with plain Horovod, native DDP / MultiWorkerMirroredStrategy,
mpi4py and ``torch.distributed``, on this machine, in real processes.

Every comparison is one *group* of contenders started in turn, round after round
(A B C A B C ...), so that slow phases of a noisy machine hit all of them alike;
a contender's figure is the median over its rounds of the median step time of
its measured steps (warm-up steps are left out).

Sections:

* ``overhead``: hvdp vs plain Horovod (``horovodrun`` directly) on the same model,
  data and settings, once with hvdp's environment copied (identical knobs) and
  once with only the thread counts (Horovod's own defaults for everything else).
* ``native``: hvdp/torch vs ``DistributedDataParallel`` (Gloo, under torchrun);
  hvdp/TensorFlow vs ``tf.distribute.MultiWorkerMirroredStrategy``.
* ``allreduce``: ``hvdp.allreduce`` vs mpi4py ``Allreduce`` vs ``torch.distributed.all_reduce``,
  4 KB to 64 MB of float32: algbw = bytes / seconds, busbw = algbw * 2 (n - 1) / n.
* ``scaling``: hvdp throughput at np=1 and np=2, one thread per rank; efficiency = T2 / (2 T1).

Example:
    >>> # hvdp bench --quick --json bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdp.errors import HvdpError

SECTIONS = ("overhead", "native", "allreduce", "scaling")
#: float32 allreduce sizes of the sweep, in bytes: 4 KB to 64 MB, by factors of 4.
SWEEP_BYTES = tuple(4096 * 4 ** k for k in range(8))
#: Thread variables every contender gets (the same as hvdp's launcher sets).
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
#: Seconds one contender's job may take before the bench gives up on it.
JOB_TIMEOUT_S = 600


class BenchError(HvdpError, ValueError):
    """``hvdp bench`` was given bad options, or a benchmark job failed."""


@dataclass
class Settings:
    """How much to measure."""

    mode: str = "quick"
    rounds: int = 2
    warmup: int = 5
    steps: int = 20
    batch: int = 32
    allreduce_budget: float = 0.15
    sections: Tuple[str, ...] = SECTIONS


@dataclass
class Contender:
    """One way of running the job: who reduces, on how many processes, under which launcher."""

    label: str
    impl: str  # hvdp | horovod | ddp | mwms | mpi4py | torchdist
    framework: str = "torch"
    np: int = 2
    controller: str = "gloo"
    knobs: str = "hvdp"  # hvdp: hvdp's environment; threads: only the thread counts; one-thread
    model: str = "cnn"
    task: str = "train"
    env: Dict[str, str] = field(default_factory=dict)  # set as if by the user (overrides hvdp's defaults)


@dataclass
class Group:
    """Contenders measured in one alternating run."""

    name: str
    contenders: List[Contender]
    runs: Dict[str, List[Any]] = field(default_factory=dict)
    rounds: Optional[int] = None  # overrides Settings.rounds


# --- pure figures ----------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    """The median of ``values``; raises BenchError when there are none.

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
    """
    if not values:
        raise BenchError("no measurements to take the median of; did every job fail?")
    return float(statistics.median(values))


def ratio(a: float, b: float) -> float:
    """``a / b``, the step-time ratio of two contenders (below 1: ``a`` is faster).

    Example:
        >>> ratio(0.09, 0.1)
        0.9
    """
    if not (b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise BenchError(f"cannot divide {a} by {b}: a step time must be a positive finite number.")
    return round(a / b, 12)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth of an allreduce, bytes per second.

    Example:
        >>> algbw(1_000_000, 0.001)
        1000000000.0
    """
    if seconds <= 0:
        raise BenchError(f"allreduce time {seconds} must be positive.")
    return nbytes / seconds


def busbw(algbw_value: float, size: int) -> float:
    """Bus bandwidth: ``algbw * 2 (n - 1) / n`` (what each rank's link carries in a ring allreduce).

    Example:
        >>> busbw(1.0e9, 2)
        1000000000.0
    """
    if size < 1:
        raise BenchError(f"process count {size} must be at least 1.")
    return algbw_value * 2 * (size - 1) / size


def efficiency(throughput_1: float, throughput_n: float, n: int = 2) -> float:
    """Scaling efficiency ``T_n / (n T_1)``.

    Example:
        >>> efficiency(100.0, 190.0)
        0.95
    """
    if throughput_1 <= 0 or n < 1:
        raise BenchError(f"efficiency needs a positive np=1 throughput and n >= 1, got {throughput_1}, {n}.")
    return throughput_n / (n * throughput_1)


@dataclass
class Target:
    """One target of the issue, with its measured value."""

    name: str
    value: Optional[float]
    op: str  # "<=" | "<" | ">="
    threshold: float
    note: str = ""

    @property
    def status(self) -> str:
        """PASS, MISS, or n/a (not measured in this run)."""
        if self.value is None:
            return "n/a"
        passed = {"<=": self.value <= self.threshold, "<": self.value < self.threshold,
                  ">=": self.value >= self.threshold}[self.op]
        return "PASS" if passed else "MISS"


# --- options ---------------------------------------------------------------------------------

def parse_sections(text: Optional[str]) -> Tuple[str, ...]:
    """``--only a,b`` as a tuple of known sections, in the canonical order.

    Example:
        >>> parse_sections("scaling,overhead")
        ('overhead', 'scaling')
    """
    if text is None:
        return SECTIONS
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise BenchError(f"--only {text!r}: unknown section {', '.join(map(repr, unknown)) or '(none given)'}. "
                         f"Expected a comma-separated subset of: {', '.join(SECTIONS)}.")
    return tuple(name for name in SECTIONS if name in names)


def make_settings(quick: bool, rounds: Optional[int], steps: Optional[int], warmup: Optional[int],
                  only: Optional[str]) -> Settings:
    """The settings for ``--quick`` or the full run, with explicit overrides checked.

    Example:
        >>> make_settings(True, None, None, None, "native").sections
        ('native',)
    """
    settings = Settings(mode="quick", rounds=2, warmup=2, steps=12, allreduce_budget=0.05) if quick else \
        Settings(mode="full", rounds=3, warmup=5, steps=30, allreduce_budget=0.4)
    for flag, value in (("--rounds", rounds), ("--steps", steps)):
        if value is not None and value < 1:
            raise BenchError(f"{flag} {value} must be at least 1; e.g. {flag} 3.")
    if warmup is not None and warmup < 0:
        raise BenchError(f"--warmup {warmup} must be 0 or more; e.g. --warmup 5.")
    settings.rounds = rounds or settings.rounds
    settings.steps = steps or settings.steps
    settings.warmup = settings.warmup if warmup is None else warmup
    settings.sections = parse_sections(only)
    return settings


def check_writable(path: Optional[str], flag: str) -> None:
    """Fail before measuring, not after, when ``path`` cannot be written."""
    if path is None:
        return
    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK) or \
            (target.exists() and not os.access(target, os.W_OK)):
        raise BenchError(f"{flag} {path!r} cannot be written (is the folder there and writable?). "
                         f"Give a file in a writable folder, e.g. {flag} /tmp/bench{Path(path).suffix or '.json'}.")


# --- plan ------------------------------------------------------------------------------------

def plan(settings: Settings) -> List[Group]:
    """The comparison groups to run for ``settings`` (quick: a subset touching every section)."""
    sections = settings.sections
    groups: List[Group] = []
    quick = settings.mode == "quick"

    def versus(framework: str, model: str, np_: int, controller: str) -> List[Contender]:
        tag = f"{framework}/{model} np={np_} {controller}"
        people: List[Contender] = []
        want_native = "native" in sections and np_ == 2 and controller == "gloo"
        if "overhead" in sections or want_native:
            people.append(Contender(f"hvdp {tag}", "hvdp", framework, np_, controller, "hvdp", model))
        # "Same knobs" on the reference CNN only (in a quick run, on torch only): it isolates hvdp's own code,
        # which is the same whatever the model.
        if "overhead" in sections and model == "cnn" and not (quick and framework == "tensorflow"):
            people.append(Contender(f"horovod (same knobs) {tag}", "horovod", framework, np_, controller,
                                    "hvdp", model))
        if "overhead" in sections:
            people.append(Contender(f"horovod (its defaults) {tag}", "horovod", framework, np_, controller,
                                    "threads", model))
        if want_native:
            native = "ddp" if framework == "torch" else "mwms"
            people.append(Contender(f"{native} {tag}", native, framework, np_, controller, "threads", model))
        return people

    frameworks = ("torch", "tensorflow")
    if quick:
        cases = [(fw, "cnn", 2, "gloo") for fw in frameworks]
    else:
        cases = [(fw, model, 2, "gloo") for fw in frameworks for model in ("cnn", "mlp", "resnet18")]
        if "overhead" in sections:
            cases += [(fw, "cnn", np_, ctl) for fw in frameworks for np_, ctl in ((2, "mpi"), (1, "gloo"),
                                                                                   (1, "mpi"))]
    for framework, model, np_, controller in cases:
        people = versus(framework, model, np_, controller)
        if len(people) > 1:
            groups.append(Group(f"{framework}/{model} np={np_} {controller}", people))
    if "scaling" in sections:
        model = "cnn" if quick else "resnet18"
        groups.append(Group(f"scaling torch/{model}", [
            Contender(f"hvdp np=1 torch/{model}", "hvdp", "torch", 1, "gloo", "one-thread", model),
            Contender(f"hvdp np=2 torch/{model}", "hvdp", "torch", 2, "gloo", "one-thread", model),
        ]))
    if "allreduce" in sections:
        people = [Contender("hvdp.allreduce (gloo)", "hvdp", np=2, controller="gloo", task="allreduce")]
        if not quick:
            people.append(Contender("hvdp.allreduce (mpi)", "hvdp", np=2, controller="mpi", task="allreduce"))
        people += [Contender("mpi4py Allreduce", "mpi4py", np=2, controller="mpi", knobs="threads",
                             task="allreduce"),
                   Contender("torch.distributed all_reduce (gloo)", "torchdist", np=2, knobs="threads",
                             task="allreduce")]
        # The sweep's own repetitions are many; in a quick run one round of each contender is enough.
        groups.append(Group("allreduce", people, rounds=1 if quick else None))
    return groups


# --- running one contender -------------------------------------------------------------------

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
    if contender.framework == "tensorflow":
        knobs["KERAS_BACKEND"] = "tensorflow"
        knobs.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    worker = ["--impl", contender.impl, "--framework", contender.framework, "--model", contender.model,
              "--batch", str(settings.batch), "--warmup", str(settings.warmup), "--steps", str(settings.steps),
              "--out", out]
    if contender.task == "allreduce":
        worker = ["--impl", contender.impl, "--sizes", ",".join(map(str, SWEEP_BYTES)),
                  "--budget", str(settings.allreduce_budget), "--out", out]
    worker = [contender.task, *worker]
    python = [sys.executable, "-m", "hvdp.bench.worker"]
    env = {**base, **knobs, "PYTHONUNBUFFERED": "1"}
    if contender.impl == "hvdp":
        return [hvdp_argv + worker], env, []
    if contender.impl in ("horovod", "mpi4py"):
        from hvdp import launch

        argv = [launch.horovodrun_path(), "-np", str(contender.np), f"--{contender.controller}", *python, *worker]
        return [argv], env, []
    if contender.impl in ("ddp", "torchdist"):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(contender.np),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "hvdp.bench.worker",
                *worker]
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
    out = workdir / f"result-{time.monotonic_ns()}.json"
    argvs, env, per = job(contender, settings, str(out), environ, cpu_count)
    log = workdir / "job.log"
    with open(log, "w") as handle:
        procs = [subprocess.Popen(argv, env={**env, **(per[i] if per else {})}, stdout=handle,
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for i, argv in enumerate(argvs)]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(-1)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if any(codes) or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise BenchError(f"{contender.label}: the job exited with {codes} and wrote no result. "
                         f"Command: {' '.join(argvs[0])}\nLast output:\n{tail}")
    record: dict = json.loads(out.read_text())
    out.unlink()
    return record


# --- the run ---------------------------------------------------------------------------------

def run_groups(groups: List[Group], settings: Settings, environ: Mapping[str, str], cpu_count: int,
               progress: Callable[[str], None],
               runner: Callable[[Contender, Settings, Path, Mapping[str, str], int], dict] = run_contender) -> None:
    """Run each group's contenders in turn, ``settings.rounds`` times (A B C A B C ...)."""
    with tempfile.TemporaryDirectory(prefix="hvdp-bench-") as tmp:
        for group in groups:
            rounds = group.rounds or settings.rounds
            for r in range(rounds):
                for contender in group.contenders:
                    start = time.monotonic()
                    record = runner(contender, settings, Path(tmp), environ, cpu_count)
                    group.runs.setdefault(contender.label, []).append(record)
                    progress(f"[{group.name}] round {r + 1}/{rounds}  {contender.label:<48} "
                             f"{_brief(record)}  ({time.monotonic() - start:.0f} s)")


def _brief(record: dict) -> str:
    if "step_seconds" in record:
        cpu = record.get("cpu_seconds_per_step")
        return f"step {median(record['step_seconds']) * 1e3:7.1f} ms" + \
            (f", rank 0 CPU {cpu * 1e3:6.1f} ms/step" if cpu is not None else "")
    largest = max(record["seconds"], key=int)
    return f"{int(largest) >> 20} MB in {median(record['seconds'][largest]) * 1e3:.1f} ms"


def summarize(groups: List[Group], settings: Settings) -> dict:
    """Every figure of the run as one JSON-ready dict (medians, ratios, bandwidths, targets)."""
    results: dict = {"groups": [], "allreduce": {}, "scaling": {}, "targets": []}
    for group in groups:
        if group.name == "allreduce":
            results["allreduce"] = _allreduce_figures(group)
            continue
        figures: dict = {"name": group.name, "contenders": {}}
        for contender in group.contenders:
            records = group.runs.get(contender.label, [])
            per_run = [median(rec["step_seconds"]) for rec in records]
            step = median(per_run)
            cpu = [rec["cpu_seconds_per_step"] for rec in records if "cpu_seconds_per_step" in rec]
            figures["contenders"][contender.label] = {
                "impl": contender.impl, "framework": contender.framework, "model": contender.model,
                "np": contender.np, "controller": contender.controller, "knobs": contender.knobs,
                "run_step_seconds": per_run, "step_seconds": step,
                "examples_per_second": contender.np * settings.batch / step,
                "cpu_seconds_per_step": median(cpu) if cpu else None,
            }
        figures["ratios"] = _ratios(group, figures["contenders"])
        if group.name.startswith("scaling"):
            one, two = (figures["contenders"][c.label]["examples_per_second"] for c in group.contenders)
            results["scaling"] = {"model": group.contenders[0].model, "throughput_np1": one, "throughput_np2": two,
                                  "efficiency": efficiency(one, two, 2)}
        results["groups"].append(figures)
    results["targets"] = [asdict(t) | {"status": t.status} for t in targets(results, settings)]
    return results


def _ratios(group: Group, contenders: Dict[str, dict]) -> Dict[str, float]:
    by_role = {(c.impl, c.knobs): contenders[c.label]["step_seconds"] for c in group.contenders}
    hvdp_step = by_role.get(("hvdp", "hvdp"))
    out: Dict[str, float] = {}
    if hvdp_step is None:
        return out
    for (impl, knobs), step in by_role.items():
        if impl == "horovod":
            key = "hvdp/horovod same knobs" if knobs == "hvdp" else "hvdp/horovod defaults"
            out[key] = ratio(hvdp_step, step)
        elif impl in ("ddp", "mwms"):
            out[f"hvdp/{impl}"] = ratio(hvdp_step, step)
    return out


def _allreduce_figures(group: Group) -> dict:
    figures: dict = {"bytes": list(SWEEP_BYTES), "impls": {}}
    for contender in group.contenders:
        records = group.runs.get(contender.label, [])
        size = records[0]["size"] if records else 2
        seconds = [median([median(rec["seconds"][str(n)]) for rec in records]) for n in SWEEP_BYTES]
        alg = [algbw(n, s) for n, s in zip(SWEEP_BYTES, seconds)]
        figures["impls"][contender.label] = {
            "seconds": seconds, "algbw_GBps": [a / 1e9 for a in alg],
            "busbw_GBps": [busbw(a, size) / 1e9 for a in alg], "np": size,
        }
    return figures


def targets(results: dict, settings: Settings) -> List[Target]:
    """The issue's targets, evaluated on what this run measured (None where it did not)."""

    def worst(key: str, framework: str) -> Optional[float]:
        values = [g["ratios"][key] for g in results["groups"] if key in g["ratios"]
                  and g["name"].startswith(framework)]
        return max(values) if values else None

    def at(name_start: str, key: str) -> Optional[float]:
        values = [g["ratios"][key] for g in results["groups"] if g["name"].startswith(name_start)
                  and key in g["ratios"]]
        return values[0] if values else None

    found: List[Target] = []
    for framework in ("torch", "tensorflow"):
        found.append(Target(f"hvdp/horovod step time, same knobs, {framework} (worst group)",
                            worst("hvdp/horovod same knobs", framework), "<=", 1.02))
        found.append(Target(f"hvdp/horovod step time, hvdp defaults, {framework} (worst group)",
                            worst("hvdp/horovod defaults", framework), "<", 1.0))
    found.append(Target("hvdp/DDP step time, torch/cnn np=2", at("torch/cnn np=2 gloo", "hvdp/ddp"), "<=", 1.0))
    found.append(Target("hvdp/MultiWorkerMirrored step time, tensorflow/cnn np=2",
                        at("tensorflow/cnn np=2 gloo", "hvdp/mwms"), "<=", 1.0))
    sweep = results.get("allreduce") or {}
    impls = sweep.get("impls", {})
    hvdp_bw = max((v["algbw_GBps"][-1] for k, v in impls.items() if k.startswith("hvdp")), default=None)
    mpi_bw = impls.get("mpi4py Allreduce", {}).get("algbw_GBps", [None])[-1]
    found.append(Target("hvdp.allreduce algbw at 64 MB / mpi4py",
                        None if hvdp_bw is None or not mpi_bw else hvdp_bw / mpi_bw, ">=", 0.9))
    scaling = results.get("scaling") or {}
    found.append(Target(f"scaling efficiency 1->2 processes ({scaling.get('model', 'resnet18')})",
                        scaling.get("efficiency"), ">=", 0.9,
                        "" if scaling.get("model", "resnet18") == "resnet18" else "target is on resnet18"))
    return found


# --- output ----------------------------------------------------------------------------------

def format_table(results: dict) -> str:
    """The run's figures as a plain-text table (what ``hvdp bench`` prints at the end)."""
    lines = [f"hvdp bench ({results.get('mode', '?')}: {results.get('rounds', '?')} rounds x "
             f"{results.get('steps', '?')} steps, {results.get('warmup', '?')} warm-up; "
             f"{results.get('date', '')}; {results.get('machine', {}).get('description', '')})", ""]
    for group in results["groups"]:
        lines.append(f"{group['name']}")
        for label, fig in group["contenders"].items():
            runs = " ".join(f"{s * 1e3:.1f}" for s in fig["run_step_seconds"])
            cpu = fig.get("cpu_seconds_per_step")
            cpu_text = f"  CPU {cpu * 1e3:6.1f} ms" if cpu is not None else ""
            lines.append(f"  {label:<50} {fig['step_seconds'] * 1e3:8.1f} ms  {fig['examples_per_second']:8.1f} ex/s"
                         f"{cpu_text}   runs: {runs}")
        for key, value in group["ratios"].items():
            lines.append(f"  ratio {key:<44} {value:8.3f}")
        lines.append("")
    sweep = results.get("allreduce")
    if sweep:
        names = list(sweep["impls"])
        lines.append("allreduce float32, np=2: algbw / busbw GB/s")
        lines.append("  " + f"{'bytes':>10}" + "".join(f"  {name[:30]:>30}" for name in names))
        for i, nbytes in enumerate(sweep["bytes"]):
            cells = "".join(f"  {sweep['impls'][n]['algbw_GBps'][i]:>14.3f} / "
                            f"{sweep['impls'][n]['busbw_GBps'][i]:<13.3f}" for n in names)
            lines.append(f"  {_human(nbytes):>10}{cells}")
        lines.append("")
    scaling = results.get("scaling")
    if scaling:
        lines.append(f"scaling {scaling['model']}: T1 {scaling['throughput_np1']:.1f} ex/s, "
                     f"T2 {scaling['throughput_np2']:.1f} ex/s, efficiency {scaling['efficiency']:.3f}")
        lines.append("")
    lines.append("targets")
    for target in results["targets"]:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        note = f"  ({target['note']})" if target.get("note") else ""
        lines.append(f"  {target['status']:<5} {target['name']:<62} {value:>7} {target['op']} "
                     f"{target['threshold']}{note}")
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def plot(results: dict, path: str) -> None:
    """Draw the ratios, the allreduce sweep and the scaling figure into ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or leave out --plot).") from exc
    bars = sum(len(group["ratios"]) for group in results["groups"])
    fig, axes = plt.subplots(2, 2, figsize=(15, max(9.0, 5.0 + 0.25 * bars)),
                             gridspec_kw={"height_ratios": [max(1.0, bars / 16), 1.0]})
    for ax, keys, title in ((axes[0][0], ("hvdp/horovod same knobs", "hvdp/horovod defaults"),
                             "Overhead: hvdp / plain Horovod step time"),
                            (axes[0][1], ("hvdp/ddp", "hvdp/mwms"), "Versus native: hvdp / native step time")):
        labels, values = [], []
        for group in results["groups"]:
            for key in keys:
                if key in group["ratios"]:
                    labels.append(f"{group['name']}: {key.split('/', 1)[1]}")
                    values.append(group["ratios"][key])
        ax.barh(range(len(values)), values, color=["tab:green" if v <= 1.0 else "tab:red" for v in values])
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_title(title)
        ax.set_xlabel("step-time ratio (< 1: hvdp faster)")
    ax = axes[1][0]
    sweep = results.get("allreduce") or {}
    for name, fig_ in sweep.get("impls", {}).items():
        ax.plot(sweep["bytes"], fig_["algbw_GBps"], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes (float32)")
    ax.set_ylabel("algbw GB/s")
    ax.set_title("Allreduce, np=2")
    if sweep:
        ax.legend(fontsize=7)
    ax = axes[1][1]
    scaling = results.get("scaling") or {}
    if scaling:
        ax.bar(["np=1", "np=2", "ideal np=2"],
               [scaling["throughput_np1"], scaling["throughput_np2"], 2 * scaling["throughput_np1"]],
               color=["tab:blue", "tab:blue", "lightgray"])
        ax.set_title(f"Scaling {scaling['model']}: efficiency {scaling['efficiency']:.2f}")
        ax.set_ylabel("examples / s")
    fig.suptitle(f"hvdp bench ({results.get('mode')}), {results.get('date')}, "
                 f"{results.get('machine', {}).get('description', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    """What the figures were measured on."""
    cpus = os.cpu_count() or 1
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": cpus, "cpu_model": model, "platform": platform.platform(), "python": platform.python_version(),
            "description": f"{cpus} CPUs{', ' + model if model else ''}"}


def main(argv: Optional[List[str]] = None) -> int:
    """``hvdp bench``: run the comparisons, print the table, write ``--json`` / ``--plot``."""
    parser = argparse.ArgumentParser(prog="hvdp bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp bench`` (shared by the hvdp CLI)."""
    parser.add_argument("--quick", action="store_true", help="a short run (< 5 min) touching every section")
    parser.add_argument("--only", metavar="SECTIONS",
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int, help="alternating rounds per comparison (quick 2, full 3)")
    parser.add_argument("--steps", type=int, help="measured steps per job (quick 12, full 30)")
    parser.add_argument("--warmup", type=int, help="warm-up steps left out (quick 2, full 5)")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures (matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run ``hvdp bench`` for parsed ``args``; raises BenchError on bad options or a failed job."""
    settings = make_settings(args.quick, args.rounds, args.steps, args.warmup, args.only)
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BenchError("--plot needs matplotlib: pip install matplotlib (or leave out --plot).") from exc
    if ("allreduce" in settings.sections or "overhead" in settings.sections) and not shutil.which("mpirun"):
        raise BenchError("hvdp bench needs mpirun for the MPI contenders: apt-get install -y openmpi-bin "
                         "libopenmpi-dev, or choose sections with --only native,scaling.")
    groups = plan(settings)
    started = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"hvdp bench {settings.mode}: {len(groups)} comparisons, {settings.rounds} rounds, "
          f"{settings.steps} steps after {settings.warmup} warm-up, contenders alternated", flush=True)
    run_groups(groups, settings, os.environ, os.cpu_count() or 1, lambda line: print(line, flush=True))
    results = {"date": date, "machine": machine(), "mode": settings.mode, "rounds": settings.rounds,
               "steps": settings.steps, "warmup": settings.warmup, "batch": settings.batch,
               "sections": list(settings.sections), "command": "hvdp bench " + " ".join(sys.argv[2:]),
               **summarize(groups, settings)}
    results["seconds"] = round(time.monotonic() - started, 1)
    print()
    print(format_table(results))
    print(f"\n(took {results['seconds']:.0f} s)")
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, str(Path(args.plot).expanduser()))
    return 0

"""What hvdp bench measures: its settings, the contenders of each comparison, and the plan of groups."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hvdp.errors import BenchError
from hvdp.frameworks import SPECS
from hvdp.launch import defaults

SECTIONS = ("overhead", "native", "allreduce", "scaling", "breakdown", "sharded")
#: The allocator settings hvdp run gives local jobs (:mod:`hvdp.launch.defaults`: glibc's and torch's),
#: given to DDP/MWMS too in the full run.
ALLOCATOR_SETTINGS = (("MALLOC_MMAP_THRESHOLD_", defaults.MALLOC_MMAP_THRESHOLD),
                   ("MALLOC_TRIM_THRESHOLD_", defaults.MALLOC_TRIM_THRESHOLD),
                   ("THP_MEM_ALLOC_ENABLE", defaults.TORCH_THP))


#: float32 allreduce sizes of the sweep, in bytes: 4 KB to 256 MB, by factors of 4 (--quick stops at 64 MB).
SWEEP_BYTES = tuple(4096 * 4 ** k for k in range(9))
QUICK_SWEEP_BYTES = SWEEP_BYTES[:8]
#: Sizes of the breakdown section, in bytes (``--breakdown``): the sweep's latency and bandwidth ends.
BREAKDOWN_BYTES = (4096, 64 << 20)


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
    sweep_bytes: Tuple[int, ...] = SWEEP_BYTES
    breakdown_bytes: Tuple[int, ...] = BREAKDOWN_BYTES
    breakdown_calls: int = 30  # timed calls per size and variant, at most
    breakdown_budget: float = 3.0  # seconds of timed calls per size and variant, about


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
    form: str = "new"  # allreduce task, hvdp: "new" (a result tensor per call) or "out" (out=, in place)
    optimizer: str = "sgd"  # train task: "sgd" (momentum 0.9) or "adam"
    shard: bool = False  # train task: hvdp shard_optimizer_state=True; ddp: torch's ZeroRedundancyOptimizer


@dataclass
class Group:
    """Contenders measured in one alternating run."""

    name: str
    contenders: List[Contender]
    runs: Dict[str, List[Any]] = field(default_factory=dict)
    rounds: Optional[int] = None  # overrides Settings.rounds


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


#: ``--smoke``: every contender of ``--quick`` once, a few steps and calls each: it proves the bench runs
#: end to end (every job, table, target, JSON and plot); its figures are not measurements.
SMOKE_SWEEP_BYTES = (SWEEP_BYTES[0], SWEEP_BYTES[7])


def make_settings(quick: bool, rounds: Optional[int], steps: Optional[int], warmup: Optional[int],
                  only: Optional[str], smoke: bool = False) -> Settings:
    """The settings for ``--quick``, ``--smoke`` or the full run, with explicit overrides checked.

    Example:
        >>> make_settings(True, None, None, None, "native").sections
        ('native',)
        >>> make_settings(False, None, None, None, None, smoke=True).rounds
        1
    """
    if smoke:
        settings = Settings(mode="smoke", rounds=1, warmup=1, steps=3, allreduce_budget=0.01,
                            sweep_bytes=SMOKE_SWEEP_BYTES, breakdown_calls=3, breakdown_budget=0.3)
    elif quick:
        settings = Settings(mode="quick", rounds=2, warmup=2, steps=12, allreduce_budget=0.05,
                            sweep_bytes=QUICK_SWEEP_BYTES, breakdown_calls=12, breakdown_budget=1.0)
    else:
        settings = Settings(mode="full", rounds=3, warmup=5, steps=30, allreduce_budget=0.4)
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


def plan(settings: Settings) -> List[Group]:
    """The comparison groups to run for ``settings`` (quick: a subset touching every section)."""
    sections = settings.sections
    groups: List[Group] = []
    quick = settings.mode in ("quick", "smoke")  # a smoke run has the quick plan, at its own size

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
        # The early wake on/off (Horovod's loop woken once a step's gradients are enqueued), on the models
        # whose steps are shortest, where a cycle's wait weighs most.
        if "overhead" in sections and np_ == 2 and controller == "gloo" and model in ("cnn", "mlp"):
            people.append(Contender(f"hvdp without early wake {tag}", "hvdp", framework, np_, controller, "hvdp",
                                    model, env={"HVDP_EARLY_WAKE": "0"}))
        # The gradient path before the direct one (hvdp.backends.torch_direct, hvdp.backends.tensorflow_direct):
        # Horovod's negotiated rounds. TensorFlow's in the full run only (a quick run's time is CI's).
        if ("overhead" in sections or want_native) and np_ == 2 and controller == "gloo" and \
                (framework == "torch" or not quick):
            people.append(Contender(f"hvdp on Horovod's gradient path {tag}", "hvdp", framework, np_, controller,
                                    "hvdp", model, env={"HVDP_GRADIENT_PATH": "horovod"}))
        if want_native:
            native = SPECS[framework].bench_native
            people.append(Contender(f"{native} {tag}", native, framework, np_, controller, "threads", model))
            # The native contender given hvdp's allocator settings too: the like-for-like ratio (in every mode).
            people.append(Contender(f"{native} with hvdp's allocator settings {tag}", native, framework, np_,
                                    controller, "threads", model, env=dict(ALLOCATOR_SETTINGS)))
        return people

    frameworks = tuple(SPECS)
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
        people = [Contender(f"hvdp np=1 torch/{model}", "hvdp", "torch", 1, "gloo", "one-thread", model),
                  Contender(f"hvdp np=2 torch/{model}", "hvdp", "torch", 2, "gloo", "one-thread", model)]
        if not quick:  # DDP's own 1 -> 2 scaling in the same run: the target compares the two efficiencies
            people += [Contender(f"ddp np=1 torch/{model}", "ddp", "torch", 1, "gloo", "one-thread", model),
                       Contender(f"ddp np=2 torch/{model}", "ddp", "torch", 2, "gloo", "one-thread", model)]
        groups.append(Group(f"scaling torch/{model}", people))
    if "allreduce" in sections:
        people = [Contender("hvdp.allreduce (gloo)", "hvdp", np=2, controller="gloo", task="allreduce"),
                  Contender("hvdp.allreduce out= (gloo)", "hvdp", np=2, controller="gloo", task="allreduce",
                            form="out")]
        if not quick:
            people += [Contender("hvdp.allreduce (mpi)", "hvdp", np=2, controller="mpi", task="allreduce"),
                       Contender("hvdp.allreduce out= (mpi)", "hvdp", np=2, controller="mpi", task="allreduce",
                                 form="out"),
                       Contender("Horovod allreduce_ in place (gloo)", "horovod", np=2, controller="gloo",
                                 task="allreduce"),
                       Contender("Horovod allreduce_ in place (mpi)", "horovod", np=2, controller="mpi",
                                 task="allreduce")]
        people += [Contender("mpi4py Allreduce", "mpi4py", np=2, controller="mpi", knobs="threads",
                             task="allreduce"),
                   Contender("torch.distributed all_reduce (gloo)", "torchdist", np=2, knobs="threads",
                             task="allreduce")]
        # The sweep's own repetitions are many; in a quick run one round of each contender is enough.
        groups.append(Group("allreduce", people, rounds=1 if quick else None))
    if "breakdown" in sections:
        # One job per controller; each alternates hvdp.allreduce and Horovod's allreduce_ call by call.
        groups.append(Group("breakdown", [
            Contender(f"allreduce breakdown ({ctl})", "hvdp", np=2, controller=ctl, task="breakdown")
            for ctl in ("gloo", "mpi")], rounds=1))
    if "sharded" in sections:
        # Adam's state sharded (hvdp shard_optimizer_state, torch's ZeroRedundancyOptimizer under DDP) beside
        # hvdp unsharded, at np=1 and np=2: step time, optimizer-state bytes and peak RSS per rank.
        models = {"torch": ("cnn", "mlp", "resnet18"), "tensorflow": ("cnn", "resnet18")}  # Keras's Adam on TF
        for framework, names in models.items():
            for model in ("cnn",) if quick else names:
                people = []
                for np_ in (1, 2):
                    tag = f"{framework}/{model} adam np={np_}"
                    people += [Contender(f"hvdp {tag}", "hvdp", framework, np_, "gloo", "one-thread", model,
                                         optimizer="adam"),
                               Contender(f"hvdp sharded {tag}", "hvdp", framework, np_, "gloo", "one-thread", model,
                                         optimizer="adam", shard=True)]
                    if framework == "torch":  # no peer shards a Keras optimizer's state
                        people.append(Contender(f"ddp ZeroRedundancyOptimizer {tag}", "ddp", "torch", np_, "gloo",
                                                "one-thread", model, optimizer="adam", shard=True))
                groups.append(Group(f"sharded {framework}/{model}", people))
    return groups

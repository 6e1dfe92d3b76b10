"""What hvdp bench measures: its settings, the contenders of each comparison, and the plan of groups."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hvdp.consistency import DEFAULT_CHECK_EVERY
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


#: Rounds every figure of a measuring run is the median (and range) of, at least.
MIN_ROUNDS = 3
#: Measured steps of a training job: one whole interval of hvdp's drift guard (hvdp.consistency's
#: default: the replicas compared every 100 optimizer steps, a collective), so that the periodic work
#: hvdp's users pay for falls inside what is measured, once per interval as in a long job.
STEADY_STEPS = DEFAULT_CHECK_EVERY
#: How a contender is configured (``Contender.knobs``): "hvdp" (hvdp's own job under ``hvdp run``, or a
#: peer given every variable hvdp run sets: like for like), "defaults" (a peer as shipped: no variable of
#: the bench's), "one-thread" (like for like at one thread per rank: the scaling and sharded sections).
KNOBS = ("hvdp", "defaults", "one-thread")


@dataclass
class Settings:
    """How much to measure."""

    mode: str = "quick"
    rounds: int = MIN_ROUNDS
    warmup: int = 5
    steps: int = STEADY_STEPS
    batch: int = 32
    allreduce_budget: float = 0.15
    sections: Tuple[str, ...] = SECTIONS
    sweep_bytes: Tuple[int, ...] = SWEEP_BYTES
    breakdown_bytes: Tuple[int, ...] = BREAKDOWN_BYTES
    breakdown_calls: int = 30  # timed calls per size and variant, at most
    breakdown_budget: float = 3.0  # seconds of timed calls per size and variant, about
    seed: int = 0  # the contenders' order in each round is a shuffle drawn from it (recorded in --results)


@dataclass
class Contender:
    """One way of running the job: who reduces, on how many processes, under which launcher."""

    label: str
    impl: str  # hvdp | horovod | ddp | mwms | mpi4py | torchdist
    framework: str = "torch"
    np: int = 2
    controller: str = "gloo"
    knobs: str = "hvdp"  # one of KNOBS: hvdp's environment (like for like), a peer's defaults, one-thread
    model: str = "cnn"
    task: str = "train"
    env: Dict[str, str] = field(default_factory=dict)  # set as if by the user (overrides hvdp's defaults)
    form: str = "new"  # allreduce task, hvdp: "new" (a result tensor per call) or "out" (out=, in place)
    optimizer: str = "sgd"  # train task: "sgd" (momentum 0.9) or "adam"
    shard: bool = False  # train task: hvdp shard_optimizer_state=True; ddp: torch's ZeroRedundancyOptimizer

    @property
    def settings(self) -> str:
        """What the table and results say of this contender's configuration: ``hvdp`` (hvdp as shipped,
        under hvdp run), ``defaults`` (the peer as shipped) or ``like-for-like`` (hvdp run's variables)."""
        if self.impl == "hvdp":
            return "hvdp"
        return "defaults" if self.knobs == "defaults" else "like-for-like"


@dataclass
class Group:
    """Contenders measured in one alternating run."""

    name: str
    contenders: List[Contender]
    runs: Dict[str, List[Any]] = field(default_factory=dict)  # label -> rank 0's record of each round
    orders: List[List[str]] = field(default_factory=list)  # the labels in the order each round ran them
    samples: List[Dict[str, Any]] = field(default_factory=list)  # every job: round, place, contender, record
    rounds: Optional[int] = None  # --smoke only, fewer rounds than Settings.rounds (a measuring run: never)


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


#: ``--smoke``: each implementation under each of its settings (every peer as shipped and like for like),
#: every task, a few steps and calls: it proves the bench runs end to end (every job, table, target, results
#: file and plot); its figures are not measurements. The torch comparison runs SMOKE_ROUNDS shuffled rounds,
#: the rest one (a TensorFlow job costs 10-20 s of CPU on 2 cores, most of it importing TensorFlow).
SMOKE_SWEEP_BYTES = (SWEEP_BYTES[0], SWEEP_BYTES[7])
SMOKE_ROUNDS = 2


def make_settings(quick: bool, rounds: Optional[int], steps: Optional[int], warmup: Optional[int],
                  only: Optional[str], smoke: bool = False, seed: Optional[int] = None) -> Settings:
    """The settings for ``--quick``, ``--smoke`` or the full run, with explicit overrides checked.

    A measuring run takes at least :data:`MIN_ROUNDS` rounds (each figure is a median with its range);
    ``seed`` (default: drawn now) orders the contenders of each round.

    Example:
        >>> make_settings(True, None, None, None, "native").sections
        ('native',)
        >>> make_settings(True, None, None, None, None).rounds, make_settings(False, None, None, None, None).steps
        (3, 100)
    """
    if smoke:
        settings = Settings(mode="smoke", rounds=SMOKE_ROUNDS, warmup=1, steps=2, allreduce_budget=0.01,
                            sweep_bytes=SMOKE_SWEEP_BYTES, breakdown_calls=3, breakdown_budget=0.3)
    elif quick:
        settings = Settings(mode="quick", warmup=2, allreduce_budget=0.05, sweep_bytes=QUICK_SWEEP_BYTES,
                            breakdown_calls=12, breakdown_budget=1.0)
    else:
        settings = Settings(mode="full", warmup=5, allreduce_budget=0.4)
    for flag, value in (("--rounds", rounds), ("--steps", steps)):
        if value is not None and value < 1:
            raise BenchError(f"{flag} {value} must be at least 1; e.g. {flag} 3.")
    if rounds is not None and rounds < MIN_ROUNDS and not smoke:
        raise BenchError(f"--rounds {rounds}: every figure is a median with its range over at least {MIN_ROUNDS} "
                         f"rounds; give --rounds {MIN_ROUNDS} or more (--smoke only checks that the bench runs).")
    if warmup is not None and warmup < 0:
        raise BenchError(f"--warmup {warmup} must be 0 or more; e.g. --warmup 5.")
    settings.rounds = rounds or settings.rounds
    settings.steps = steps or settings.steps
    settings.warmup = settings.warmup if warmup is None else warmup
    settings.sections = parse_sections(only)
    settings.seed = int.from_bytes(os.urandom(4), "big") if seed is None else seed
    return settings


def notes(settings: Settings) -> List[str]:
    """What the run's header warns of: measured steps that leave hvdp's periodic work out."""
    first, last = settings.warmup + 1, settings.warmup + settings.steps
    if settings.mode != "smoke" and last // STEADY_STEPS * STEADY_STEPS < first:
        return [f"note: the drift guard runs every {STEADY_STEPS} steps and none of steps {first}-{last} is one: "
                f"hvdp's training figures leave its cost out (give --steps {STEADY_STEPS} or more)."]
    return []


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


def _pair(label: str, impl: str, framework: str = "torch", np_: int = 2, controller: str = "gloo",
          model: str = "cnn", **options: Any) -> List[Contender]:
    """A peer twice: with its own defaults as shipped, and like for like (every variable hvdp run sets)."""
    return [Contender(f"{label} [defaults]", impl, framework, np_, controller, "defaults", model, **options),
            Contender(f"{label} [like for like]", impl, framework, np_, controller, "hvdp", model, **options)]


def plan(settings: Settings) -> List[Group]:
    """The comparison groups to run for ``settings`` (quick: a subset touching every section; smoke: the
    quick plan's implementations under each of their settings and tasks, without hvdp's variants: its
    on/off settings, ``out=``, one thread at np=1 and 2 (the scaling section), the sharded section at np=1).

    Every contender of a training group does the same work per step (forward, backward, one average of
    the gradients across ranks, the optimizer's update): none reduces anything more.
    """
    sections = settings.sections
    groups: List[Group] = []
    smoke = settings.mode == "smoke"
    quick = settings.mode in ("quick", "smoke")  # a smoke run has the quick plan, at its own size, trimmed

    def versus(framework: str, model: str, np_: int, controller: str) -> List[Contender]:
        tag = f"{framework}/{model} np={np_} {controller}"
        people: List[Contender] = []
        want_native = "native" in sections and np_ == 2 and controller == "gloo"
        if "overhead" in sections or want_native:
            people.append(Contender(f"hvdp {tag}", "hvdp", framework, np_, controller, "hvdp", model))
        if "overhead" in sections:
            people += _pair(f"horovod {tag}", "horovod", framework, np_, controller, model)
        # The early wake on/off (Horovod's loop woken once a step's gradients are enqueued), on the models
        # whose steps are shortest, where a cycle's wait weighs most.
        if "overhead" in sections and np_ == 2 and controller == "gloo" and model in ("cnn", "mlp") and not smoke:
            people.append(Contender(f"hvdp without early wake {tag}", "hvdp", framework, np_, controller, "hvdp",
                                    model, env={"HVDP_EARLY_WAKE": "0"}))
        # The gradient path before the direct one (hvdp.backends.torch.direct.gradients,
        # hvdp.backends.tensorflow.direct): Horovod's negotiated rounds. TensorFlow's in the full run only.
        if ("overhead" in sections or want_native) and np_ == 2 and controller == "gloo" and \
                (framework == "torch" or not quick) and not smoke:
            people.append(Contender(f"hvdp on Horovod's gradient path {tag}", "hvdp", framework, np_, controller,
                                    "hvdp", model, env={"HVDP_GRADIENT_PATH": "horovod"}))
        if want_native:
            native = SPECS[framework].bench_native
            people += _pair(f"{native} {tag}", native, framework, np_, controller, model)
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
    if "scaling" in sections and not smoke:
        model = "cnn" if quick else "resnet18"
        people = [Contender(f"hvdp np=1 torch/{model}", "hvdp", "torch", 1, "gloo", "one-thread", model),
                  Contender(f"hvdp np=2 torch/{model}", "hvdp", "torch", 2, "gloo", "one-thread", model)]
        if not quick:  # DDP's own 1 -> 2 scaling in the same run (one thread per rank: like for like)
            people += [Contender(f"ddp np=1 torch/{model} [like for like]", "ddp", "torch", 1, "gloo", "one-thread",
                                 model),
                       Contender(f"ddp np=2 torch/{model} [like for like]", "ddp", "torch", 2, "gloo", "one-thread",
                                 model)]
        groups.append(Group(f"scaling torch/{model}", people))
    if "allreduce" in sections:
        people = [Contender("hvdp.allreduce (gloo)", "hvdp", np=2, controller="gloo", task="allreduce")]
        if not smoke:
            people.append(Contender("hvdp.allreduce out= (gloo)", "hvdp", np=2, controller="gloo", task="allreduce",
                                    form="out"))
        if not quick:
            people += [Contender("hvdp.allreduce (mpi)", "hvdp", np=2, controller="mpi", task="allreduce"),
                       Contender("hvdp.allreduce out= (mpi)", "hvdp", np=2, controller="mpi", task="allreduce",
                                 form="out")]
            for ctl in ("gloo", "mpi"):
                people += _pair(f"Horovod allreduce_ in place ({ctl})", "horovod", controller=ctl, task="allreduce")
        people += _pair("mpi4py Allreduce", "mpi4py", controller="mpi", task="allreduce")
        people += _pair("torch.distributed all_reduce (gloo)", "torchdist", task="allreduce")
        groups.append(Group("allreduce", people))
    if "breakdown" in sections:
        # One job per controller; each alternates hvdp.allreduce and Horovod's allreduce_ call by call (in the
        # same processes, so under the same settings: hvdp run's).
        groups.append(Group("breakdown", [
            Contender(f"allreduce breakdown ({ctl})", "hvdp", np=2, controller=ctl, task="breakdown")
            for ctl in (("gloo",) if smoke else ("gloo", "mpi"))]))
    if "sharded" in sections:
        # Adam's state sharded (hvdp shard_optimizer_state, torch's ZeroRedundancyOptimizer under DDP) beside
        # hvdp unsharded, at np=1 and np=2: step time, optimizer-state bytes and peak RSS per rank.
        models = {"torch": ("cnn", "mlp", "resnet18"), "tensorflow": ("cnn", "resnet18")}  # Keras's Adam on TF
        for framework, names in models.items():
            for model in ("cnn",) if quick else names:
                people = []
                for np_ in (2,) if smoke else (1, 2):
                    tag = f"{framework}/{model} adam np={np_}"
                    people += [Contender(f"hvdp {tag}", "hvdp", framework, np_, "gloo", "one-thread", model,
                                         optimizer="adam"),
                               Contender(f"hvdp sharded {tag}", "hvdp", framework, np_, "gloo", "one-thread", model,
                                         optimizer="adam", shard=True)]
                    if framework == "torch":  # no peer shards a Keras optimizer's state
                        zero = _pair(f"ddp ZeroRedundancyOptimizer {tag}", "ddp", "torch", np_, "gloo", model,
                                     optimizer="adam", shard=True)
                        zero[1].knobs = "one-thread"  # like for like here: one thread per rank, as hvdp's
                        people += zero
                groups.append(Group(f"sharded {framework}/{model}", people))
    if smoke:
        for group in groups[1:]:
            group.rounds = 1
    return groups

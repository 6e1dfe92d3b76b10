"""``hvdp report DIR``: per-rank step times and phases from ``hvdp.profiler``, and why ranks wait.

The diagnosis compares the work each rank does before it can synchronize
(phases ``data`` + ``compute``). A rank that takes clearly longer than the
fastest one is a straggler, and the others wait for it in ``sync``; whether
its extra time is in ``data`` or in ``compute`` says if the cause is input
skew or compute skew. Without a straggler, a large ``sync`` share means the
step is bound by gradient synchronization itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from hvdp.errors import ReportError

#: A straggler's extra work must exceed this share of the step time ...
STRAGGLER_SHARE = 0.10
#: ... and this many seconds (so timer noise on tiny steps names no one).
STRAGGLER_MIN_SECONDS = 0.002
#: Without a straggler, a sync share above this makes the step synchronization-bound.
SYNC_BOUND_SHARE = 0.30


@dataclass
class RankSummary:
    """Medians over the measured steps of one rank."""

    rank: int
    steps: int
    step_seconds: float
    examples_per_second: Optional[float]
    phases: Dict[str, float]

    @property
    def busy(self) -> float:
        """Work before synchronization: data + compute."""
        return self.phases.get("data", 0.0) + self.phases.get("compute", 0.0)


@dataclass
class Diagnosis:
    """The answer to "why do ranks wait?", with the numbers behind it."""

    verdict: str  # "input skew" | "compute skew" | "synchronization" | "balanced"
    stragglers: List[int]
    explanation: str
    numbers: Dict[str, float] = field(default_factory=dict)


def load(directory: Path) -> Dict[int, List[dict]]:
    """Every rank's step records, by rank. Raises ValueError naming a bad file or line."""
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory. Give the DIR passed to hvdp run --profile DIR.")
    files = sorted(directory.glob("rank*.jsonl"))
    if not files:
        raise ValueError(f"{directory} has no rank*.jsonl files: was the job run with hvdp run --profile "
                         f"{directory} (or hvdp.profiler.enable) and did it call hvdp.profiler.step()?")
    records: Dict[int, List[dict]] = {}
    for path in files:
        try:
            rank = int(path.stem[len("rank"):])
        except ValueError:
            raise ValueError(f"{path.name}: expected a name like rank0.jsonl.") from None
        steps = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                float(entry["seconds"])
                dict(entry["phases"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number} is not an hvdp.profiler record: {line[:80]!r}") from None
            steps.append(entry)
        records[rank] = steps
    return records


def summarize(records: Dict[int, List[dict]], skip: Optional[int] = None) -> List[RankSummary]:
    """Per-rank medians, leaving out the first ``skip`` steps (default: 10%, at least 1) as warm-up."""
    summaries = []
    for rank, steps in sorted(records.items()):
        drop = skip if skip is not None else max(1, len(steps) // 10)
        kept = steps[drop:] if len(steps) > drop else steps
        if not kept:
            raise ValueError(f"rank {rank} recorded no steps.")
        names = sorted({name for s in kept for name in s["phases"]})
        phases = {name: statistics.median(s["phases"].get(name, 0.0) for s in kept) for name in names}
        step_seconds = statistics.median(s["seconds"] for s in kept)
        examples = [s["examples"] for s in kept if s.get("examples")]
        rate = statistics.median(examples) / step_seconds if examples and step_seconds > 0 else None
        summaries.append(RankSummary(rank, len(kept), step_seconds, rate, phases))
    return summaries


def diagnose(summaries: List[RankSummary]) -> Diagnosis:
    """Name the straggler(s) and the cause, or say there is none."""
    step = max(s.step_seconds for s in summaries)
    fastest = min(s.busy for s in summaries)
    excess = {s.rank: s.busy - fastest for s in summaries}
    threshold = max(STRAGGLER_SHARE * step, STRAGGLER_MIN_SECONDS)
    worst = max(excess.values())
    stragglers = [r for r, e in excess.items() if e > threshold and e >= 0.5 * worst]
    sync_share = statistics.median(s.phases.get("sync", 0.0) / s.step_seconds for s in summaries if s.step_seconds)
    numbers = {"step_seconds": step, "sync_share": sync_share, "threshold_seconds": threshold}
    if stragglers:
        others = [s for s in summaries if s.rank not in stragglers] or summaries
        base_data = statistics.median(s.phases.get("data", 0.0) for s in others)
        base_compute = statistics.median(s.phases.get("compute", 0.0) for s in others)
        lines = []
        data_total = compute_total = 0.0
        for s in summaries:
            if s.rank not in stragglers:
                continue
            extra_data = s.phases.get("data", 0.0) - base_data
            extra_compute = s.phases.get("compute", 0.0) - base_compute
            data_total += extra_data
            compute_total += extra_compute
            lines.append(f"rank {s.rank} spends {ms(s.phases.get('data', 0))} in data and "
                         f"{ms(s.phases.get('compute', 0))} in compute per step, vs {ms(base_data)} and "
                         f"{ms(base_compute)} on the other ranks")
            numbers[f"rank{s.rank}_extra_data_seconds"] = extra_data
            numbers[f"rank{s.rank}_extra_compute_seconds"] = extra_compute
        verdict = "input skew" if data_total >= compute_total else "compute skew"
        waiting = statistics.median(s.phases.get("sync", 0.0) for s in others)
        numbers["others_sync_seconds"] = waiting
        cause = ("its input pipeline is slower (data phase)" if verdict == "input skew"
                 else "it computes slower (compute phase)")
        names = ", ".join(f"rank {r}" for r in stragglers)
        explanation = (f"{verdict}: {names} is the straggler: {cause}. " + "; ".join(lines) +
                       f". The other ranks wait {ms(waiting)} per step in gradient sync "
                       f"({waiting / step:.0%} of the {ms(step)} step).")
        return Diagnosis(verdict, sorted(stragglers), explanation, numbers)
    if sync_share > SYNC_BOUND_SHARE:
        return Diagnosis("synchronization", [], (
            f"synchronization: no straggler (ranks' work differs by at most {ms(worst)}), but gradient sync "
            f"takes {sync_share:.0%} of the {ms(step)} step. Fewer, larger allreduces (fusion), fp16 "
            "compression or a larger batch per replica would help."), numbers)
    return Diagnosis("balanced", [], (
        f"balanced: no straggler (ranks' work differs by at most {ms(worst)}); gradient sync takes "
        f"{sync_share:.0%} of the {ms(step)} step."), numbers)


def ms(seconds: float) -> str:
    """Seconds as a short millisecond string."""
    return f"{seconds * 1000:.1f} ms"


def _ordered_phases(summaries: List[RankSummary]) -> List[str]:
    """data, compute, sync first, then any other phase by name."""
    known = ("data", "compute", "sync")
    return sorted({n for s in summaries for n in s.phases}, key=lambda n: (known.index(n) if n in known else 3, n))


def render(summaries: List[RankSummary], diagnosis: Diagnosis) -> str:
    """The report as a table and a diagnosis, for people."""
    names = _ordered_phases(summaries)
    head = f"{'rank':>4} {'steps':>6} {'step':>10} {'ex/s/replica':>13} " + " ".join(f"{n:>10}" for n in names)
    rows = [head]
    for s in summaries:
        rate = f"{s.examples_per_second:.0f}" if s.examples_per_second else "-"
        rows.append(f"{s.rank:>4} {s.steps:>6} {ms(s.step_seconds):>10} {rate:>13} "
                    + " ".join(f"{ms(s.phases.get(n, 0.0)):>10}" for n in names))
    rows.append("(medians per step; 'sync' is the time DistributedOptimizer waited for the gradient allreduce)")
    rows.append("")
    rows.append("Diagnosis: " + diagnosis.explanation)
    return "\n".join(rows)


def plot(records: Dict[int, List[dict]], summaries: List[RankSummary], path: Path) -> None:
    """Per-rank stacked phase bars, and step time over the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("hvdp report --plot needs matplotlib: pip install matplotlib") from exc
    names = _ordered_phases(summaries)
    figure, (bars, lines) = plt.subplots(1, 2, figsize=(11, 4))
    bottoms = [0.0] * len(summaries)
    ranks = [str(s.rank) for s in summaries]
    for name in [*names, "other"]:
        heights = [1000 * (s.phases.get(name, 0.0) if name != "other"
                           else max(0.0, s.step_seconds - sum(s.phases.values()))) for s in summaries]
        bars.bar(ranks, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    bars.set_xlabel("rank")
    bars.set_ylabel("ms per step (median)")
    bars.set_title("where each rank's step goes")
    bars.legend()
    for rank, steps in sorted(records.items()):
        lines.plot([s["step"] for s in steps], [1000 * s["seconds"] for s in steps], label=f"rank {rank}")
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms)")
    lines.set_title("step time over the run")
    lines.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


#: What ``hvdp report --help`` says above the options.
DESCRIPTION = """\
Read the per-rank records hvdp.profiler wrote (hvdp run --profile DIR) and print each
rank's step time and phases (data, compute, sync), throughput, and why ranks wait:
a straggler with input or compute skew, or synchronization itself. Takes a second."""
#: What ``hvdp report --help`` says below the options.
EPILOG = """examples:
  hvdp report /tmp/profile                          the table and the diagnosis
  hvdp report /tmp/profile --skip 5 --plot p.png    leave out 5 warm-up steps, draw the phases
  hvdp report /tmp/profile --json                   the same figures as JSON"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp report`` and its help text, on the CLI's subparser."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("directory", help="the DIR given to hvdp run --profile or hvdp.profiler.enable")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw per-rank phase bars and step times")
    parser.add_argument("--skip", type=int, default=None, help="warm-up steps to leave out (default: 10%%)")


def main(args: argparse.Namespace) -> int:
    """``hvdp report DIR``: print the report (or ``--json``), optionally draw the ``--plot``.

    A directory, record or plot it cannot use is a :class:`~hvdp.errors.ReportError` (one line, exit status 2
    from the CLI).
    """
    plot_path = args.plot
    try:
        records = load(Path(args.directory))
        summaries = summarize(records, args.skip)
        diagnosis = diagnose(summaries)
        if plot_path:
            plot(records, summaries, Path(plot_path))
    except ValueError as exc:
        raise ReportError(str(exc)) from exc
    if args.json:
        print(json.dumps({"ranks": [{**asdict(s), "busy_seconds": s.busy} for s in summaries],
                          "diagnosis": asdict(diagnosis)}, indent=2))
    else:
        print(render(summaries, diagnosis))
        if plot_path:
            print(f"Plot: {plot_path}")
    return 0

"""``hvdp bench``: hvdp measured side by side with plain Horovod, native DDP / MultiWorkerMirroredStrategy,
mpi4py and ``torch.distributed``, on this machine, in real processes.

Every comparison is one *group* of contenders started one at a time, round after round,
in a shuffled order per round (seeded; ``--seed``), so that slow phases of a noisy machine
hit all of them alike; a contender's figure is the median, with the range, over at least
3 rounds of its mean step time over the measured steps (warm-up steps are left out; the
measured steps cover an interval of hvdp's drift guard, so its check is paid as in a long
job); each ratio is taken round by round, and given as its median and range. Every
contender's timed step does the same work. hvdp runs under ``hvdp run``, as its users run it;
every peer runs twice: as shipped (``[defaults]``) and like for like (``[like for like]``:
every variable hvdp run sets). ``--results FILE`` keeps every sample (:mod:`hvdp.bench.results`).

Sections:

* ``overhead``: hvdp vs plain Horovod (horovodrun's command line) on the same model and
  data, once as shipped and once with hvdp run's variables (like for like).
* ``native``: hvdp/torch vs ``DistributedDataParallel`` (Gloo, under torchrun);
  hvdp/TensorFlow vs ``tf.distribute.MultiWorkerMirroredStrategy``.
* ``allreduce``: ``hvdp.allreduce`` vs mpi4py ``Allreduce`` vs ``torch.distributed.all_reduce``,
  4 KB to 64 MB of float32: algbw = bytes / seconds, busbw = algbw * 2 (n - 1) / n.
* ``scaling``: hvdp throughput at np=1 and np=2, one thread per rank; efficiency = T2 / (2 T1).
* ``breakdown``: where each ``hvdp.allreduce`` call's time goes (Python, allocation, cycle wait,
  negotiation, copies, transport), beside Horovod's in-place op, under Gloo and MPI
  (:mod:`hvdp.bench.breakdown`).
* ``sharded``: Adam with hvdp's ``shard_optimizer_state`` beside hvdp unsharded and torch's
  ``ZeroRedundancyOptimizer`` under DDP, at np=1 and np=2: step time, optimizer-state bytes and
  peak RSS of every rank; and Keras's Adam (TensorFlow) sharded beside unsharded.

Example:
    >>> # hvdp bench --quick --results results.json --plot bench.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

from hvdp.bench import results as results_file
from hvdp.bench.breakdown import parse_sizes as parse_breakdown_sizes
from hvdp.bench.plan import (
    ALLOCATOR_SETTINGS,
    MIN_ROUNDS,
    SECTIONS,
    SWEEP_BYTES,
    Contender,
    Group,
    Settings,
    check_writable,
    make_settings,
    notes,
    parse_sections,
    plan,
)
from hvdp.bench.plot import plot
from hvdp.bench.report import Target, format_table, summarize, targets
from hvdp.bench.results import machine
from hvdp.bench.runner import (
    JOB_TIMEOUT_S,
    SMOKE_JOBS_AT_ONCE,
    THREAD_VARS,
    hvdp_env,
    job,
    round_orders,
    run_contender,
    run_groups,
)
from hvdp.bench.stats import algbw, busbw, efficiency, mean_step, median, ratio, ratio_spread
from hvdp.errors import BenchError

__all__ = [
    "DESCRIPTION", "EPILOG", "JOB_TIMEOUT_S", "ALLOCATOR_SETTINGS", "MIN_ROUNDS", "SECTIONS", "SMOKE_JOBS_AT_ONCE",
    "SWEEP_BYTES",
    "THREAD_VARS",
    "BenchError", "Contender",
    "Group", "Settings", "Target", "add_arguments", "algbw", "busbw", "check_writable", "efficiency", "format_table",
    "hvdp_env", "job", "machine", "main", "make_settings", "mean_step", "median", "notes", "parse_breakdown_sizes",
    "parse_sections", "plan", "plot", "ratio", "ratio_spread", "round_orders",
    "run_contender", "run_groups", "summarize", "targets",
]


#: What ``hvdp bench --help`` says above the options.
DESCRIPTION = """\
Measure hvdp side by side with plain Horovod, DistributedDataParallel,
MultiWorkerMirroredStrategy, mpi4py and torch.distributed, on this machine,
in real multi-process jobs, and print one table of the figures: each a median
with its range over at least 3 rounds, the contenders shuffled in each round.
Takes hours (the full run) or about 40 min (--quick) on 2 cores."""
#: What ``hvdp bench --help`` says below the options.
EPILOG = """examples:
  hvdp bench --quick --results quick.json          each comparison, 3 rounds, every sample kept
  hvdp bench --smoke --results smoke.json          each contender, 2 steps: does it run (CI)
  hvdp bench --only allreduce --json ar.json       one section, every figure written to ar.json
  hvdp bench --only breakdown --breakdown 4K,64M   an allreduce call's time, by phase
  hvdp bench --only sharded                        sharded Adam: time, memory per rank
  hvdp bench --results bench.json --plot bench.png the full run, with a plot (hours)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp bench`` and its help text (shared by the hvdp CLI)."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a shorter run touching every section")
    size.add_argument("--smoke", action="store_true",
                      help="every kind of contender, 2 steps (the torch comparison over 2 shuffled rounds): "
                           "it runs (figures not measurements)")
    parser.add_argument("--only", metavar="SECTIONS",
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int,
                        help=f"shuffled rounds per comparison (at least {MIN_ROUNDS}; default {MIN_ROUNDS})")
    parser.add_argument("--steps", type=int,
                        help="measured steps per job (default 100: one interval of hvdp's drift guard)")
    parser.add_argument("--warmup", type=int, help="warm-up steps left out (quick 2, full 5)")
    parser.add_argument("--breakdown", metavar="SIZES",
                        help="sizes of the breakdown section, e.g. 4K,64M (default: 4K,64M)")
    parser.add_argument("--seed", type=int, help="the seed of each round's order (default: drawn, then recorded)")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--results", metavar="FILE", help="write the command, machine, versions, each contender's "
                        "settings, every sample and the figures to FILE (docs/results/README.md)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures (matplotlib)")


def main(args: argparse.Namespace) -> int:
    """``hvdp bench``: run the comparisons, print the table, write ``--json`` / ``--plot``.

    Raises BenchError on bad options or a failed job.
    """
    settings = make_settings(args.quick, args.rounds, args.steps, args.warmup, args.only, smoke=args.smoke,
                             seed=getattr(args, "seed", None))
    if getattr(args, "breakdown", None):
        if "breakdown" not in settings.sections:
            raise BenchError(f"--breakdown {args.breakdown} sets the sizes of the breakdown section, which --only "
                             f"{args.only} leaves out: add it, e.g. --only {args.only},breakdown.")
        settings.breakdown_bytes = parse_breakdown_sizes(args.breakdown)
    check_writable(args.json, "--json")
    check_writable(getattr(args, "results", None), "--results")
    check_writable(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BenchError("--plot needs matplotlib: pip install matplotlib (or leave out --plot).") from exc
    if {"allreduce", "overhead", "breakdown"} & set(settings.sections) and not shutil.which("mpirun"):
        raise BenchError("hvdp bench needs mpirun for the MPI contenders: apt-get install -y openmpi-bin "
                         "libopenmpi-dev, or choose sections with --only native,scaling.")
    groups = plan(settings)
    started = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    start = {"date": date, "load": results_file.load_average()}
    print(f"hvdp bench {settings.mode}: {len(groups)} comparisons, {settings.rounds} rounds, "
          f"{settings.steps} steps after {settings.warmup} warm-up, contenders shuffled in each round (seed "
          f"{settings.seed})" + (f", {SMOKE_JOBS_AT_ONCE} jobs at a time (a smoke run measures nothing)"
                                 if settings.mode == "smoke" else ""), flush=True)
    for line in notes(settings):
        print(line, flush=True)
    run_groups(groups, settings, os.environ, os.cpu_count() or 1, lambda line: print(line, flush=True))
    results = {"date": date, "machine": machine(), "mode": settings.mode, "rounds": settings.rounds,
               "seed": settings.seed,
               "steps": settings.steps, "warmup": settings.warmup, "batch": settings.batch,
               "sections": list(settings.sections), "command": "hvdp bench " + " ".join(sys.argv[2:]),
               **summarize(groups, settings)}
    results["seconds"] = round(time.monotonic() - started, 1)
    print()
    print(format_table(results))
    print(f"\n(took {results['seconds']:.0f} s)")
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(results, indent=2) + "\n")
    if getattr(args, "results", None):
        kept = results_file.document(["hvdp", *sys.argv[1:]], groups, settings, results, start, os.environ,
                                     os.cpu_count() or 1)
        Path(args.results).expanduser().write_text(json.dumps(kept, indent=1) + "\n")
    if args.plot:
        plot(results, str(Path(args.plot).expanduser()))
    return 0

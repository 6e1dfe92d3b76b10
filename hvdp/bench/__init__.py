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
* ``breakdown``: where each ``hvdp.allreduce`` call's time goes (Python, allocation, cycle wait,
  negotiation, copies, transport), beside Horovod's in-place op, under Gloo and MPI
  (:mod:`hvdp.bench.breakdown`).
* ``sharded``: Adam with hvdp's ``shard_optimizer_state`` beside hvdp unsharded and torch's
  ``ZeroRedundancyOptimizer`` under DDP, at np=1 and np=2: step time, optimizer-state bytes and
  peak RSS of every rank; and Keras's Adam (TensorFlow) sharded beside unsharded.

Example:
    >>> # hvdp bench --quick --json bench.json --plot bench.png
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

from hvdp.bench.breakdown import parse_sizes as parse_breakdown_sizes
from hvdp.bench.plan import (
    ALLOCATOR_SETTINGS,
    SECTIONS,
    SWEEP_BYTES,
    Contender,
    Group,
    Settings,
    check_writable,
    make_settings,
    parse_sections,
    plan,
)
from hvdp.bench.report import Target, format_table, machine, plot, summarize, targets
from hvdp.bench.runner import JOB_TIMEOUT_S, SMOKE_JOBS_AT_ONCE, THREAD_VARS, hvdp_env, job, run_contender, run_groups
from hvdp.bench.stats import algbw, busbw, efficiency, median, ratio
from hvdp.errors import BenchError

__all__ = [
    "DESCRIPTION", "EPILOG", "JOB_TIMEOUT_S", "ALLOCATOR_SETTINGS", "SECTIONS", "SMOKE_JOBS_AT_ONCE", "SWEEP_BYTES",
    "THREAD_VARS",
    "BenchError", "Contender",
    "Group", "Settings", "Target", "add_arguments", "algbw", "busbw", "check_writable", "efficiency", "format_table",
    "hvdp_env", "job", "machine", "main", "make_settings", "median", "parse_breakdown_sizes", "parse_sections", "plan",
    "plot", "ratio",
    "run_contender", "run_groups", "summarize", "targets",
]


#: What ``hvdp bench --help`` says above the options.
DESCRIPTION = """\
Measure hvdp side by side with plain Horovod, DistributedDataParallel,
MultiWorkerMirroredStrategy, mpi4py and torch.distributed, on this machine,
in real multi-process jobs, and print one table of the figures.
Takes about 35 min (the full run) or about 5 min (--quick) on 2 cores."""
#: What ``hvdp bench --help`` says below the options.
EPILOG = """examples:
  hvdp bench --quick                               every kind of comparison, 2 rounds (about 3 min)
  hvdp bench --smoke                               every contender once, 3 steps: does it run (CI)
  hvdp bench --only allreduce --json ar.json       one section, every figure written to ar.json
  hvdp bench --only breakdown --breakdown 4K,64M   an allreduce call's time, by phase (1 min)
  hvdp bench --only sharded                        sharded Adam: time, memory per rank (10 min)
  hvdp bench --json bench.json --plot bench.png    the full run, with a plot (about 35 min)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp bench`` and its help text (shared by the hvdp CLI)."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a short run (< 5 min) touching every section")
    size.add_argument("--smoke", action="store_true",
                      help="every contender of --quick once, 3 steps: it runs (figures not measurements)")
    parser.add_argument("--only", metavar="SECTIONS",
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int, help="alternating rounds per comparison (quick 2, full 3)")
    parser.add_argument("--steps", type=int, help="measured steps per job (quick 12, full 30)")
    parser.add_argument("--warmup", type=int, help="warm-up steps left out (quick 2, full 5)")
    parser.add_argument("--breakdown", metavar="SIZES",
                        help="sizes of the breakdown section, e.g. 4K,64M (default: 4K,64M)")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures (matplotlib)")


def main(args: argparse.Namespace) -> int:
    """``hvdp bench``: run the comparisons, print the table, write ``--json`` / ``--plot``.

    Raises BenchError on bad options or a failed job.
    """
    settings = make_settings(args.quick, args.rounds, args.steps, args.warmup, args.only, smoke=args.smoke)
    if getattr(args, "breakdown", None):
        if "breakdown" not in settings.sections:
            raise BenchError(f"--breakdown {args.breakdown} sets the sizes of the breakdown section, which --only "
                             f"{args.only} leaves out: add it, e.g. --only {args.only},breakdown.")
        settings.breakdown_bytes = parse_breakdown_sizes(args.breakdown)
    check_writable(args.json, "--json")
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
    print(f"hvdp bench {settings.mode}: {len(groups)} comparisons, {settings.rounds} rounds, "
          f"{settings.steps} steps after {settings.warmup} warm-up, "
          + (f"{SMOKE_JOBS_AT_ONCE} jobs at a time (a smoke run measures nothing)" if settings.mode == "smoke"
             else "contenders alternated"), flush=True)
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

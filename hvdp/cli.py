"""The ``hvdp`` command: ``run``, ``doctor``, ``report``, ``bench`` and ``build``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from hvdp.errors import HvdpError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdp", description="Data-parallel training over Horovod, for PyTorch and TensorFlow.")
    from hvdp import __version__

    parser.add_argument("--version", action="version", version=f"hvdp {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    sub.add_parser("run", help="launch a training script on N processes (see hvdp run --help)",
                   add_help=False)
    doctor = sub.add_parser("doctor", help="show versions, what Horovod was built with, and problems")
    doctor.add_argument("--json", action="store_true", help="print machine-readable JSON")
    report = sub.add_parser("report", help="per-rank step times and why ranks wait (from hvdp run --profile DIR)")
    report.add_argument("directory", help="the DIR given to hvdp run --profile or hvdp.profiler.enable")
    report.add_argument("--json", action="store_true", help="print machine-readable JSON")
    report.add_argument("--plot", metavar="FILE.png", help="draw per-rank phase bars and step times")
    report.add_argument("--skip", type=int, default=None, help="warm-up steps to leave out (default: 10%%)")
    bench = sub.add_parser("bench", help="hvdp vs plain Horovod, DDP, MultiWorkerMirroredStrategy and mpi4py, "
                                         "side by side (see hvdp bench --help)")
    from hvdp.bench import add_arguments as bench_arguments

    bench_arguments(bench)
    build = sub.add_parser("build", help="build Horovod 0.28.1 for the installed frameworks and cache it")
    build.add_argument("--frameworks", default=None,
                       help="comma-separated subset of torch,tensorflow (default: all installed)")
    build.add_argument("--gpu", action="store_true", help="build with NCCL for CUDA GPUs")
    build.add_argument("--xla", action="store_true", help="also compile TensorFlow's XLA ops")
    build.add_argument("--no-mpi", action="store_true", help="build with Gloo only")
    build.add_argument("--force", action="store_true", help="rebuild even when a cached wheel matches")
    build.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hvdp`` console script."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_in[:1] == ["run"]:
            from hvdp import launch

            return launch.run(args_in[1:])
        args = _parser().parse_args(args_in)
        if args.cmd == "doctor":
            from hvdp import doctor

            return doctor.main(as_json=args.json)
        if args.cmd == "report":
            from hvdp import report

            try:
                return report.main(args.directory, as_json=args.json, plot_path=args.plot, skip=args.skip)
            except ValueError as exc:
                print(f"hvdp: error: {exc}", file=sys.stderr)
                return 2
        if args.cmd == "bench":
            from hvdp import bench as bench_module

            return bench_module.run(args)
        if args.cmd == "build":
            from hvdp import build

            options = build.BuildOptions(
                frameworks=[f.strip() for f in args.frameworks.split(",") if f.strip()] if args.frameworks else None,
                gpu=args.gpu, xla=args.xla, mpi=not args.no_mpi, force=args.force,
            )
            if args.jobs is not None:
                if args.jobs < 1:
                    raise build.BuildError(f"--jobs {args.jobs} must be at least 1 (the number of parallel "
                                           "compile jobs); leave it out to use every core.")
                options.jobs = args.jobs
            build.build(options, progress=lambda line: print(line, flush=True))
            return 0
    except HvdpError as exc:
        print(f"hvdp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())

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
    from hvdp.doctor import add_arguments as doctor_arguments
    from hvdp.report import add_arguments as report_arguments

    doctor_arguments(sub.add_parser("doctor", help="show versions, what Horovod was built with, and problems"))
    report_arguments(sub.add_parser("report", help="per-rank step times and why ranks wait "
                                                   "(from hvdp run --profile DIR)"))
    bench = sub.add_parser("bench", help="hvdp vs plain Horovod, DDP, MultiWorkerMirroredStrategy and mpi4py, "
                                         "side by side (see hvdp bench --help)")
    from hvdp.bench import add_arguments as bench_arguments

    bench_arguments(bench)
    from hvdp.horovod_build.command import add_arguments as build_arguments

    build_arguments(sub.add_parser("build", help="build Horovod 0.28.1 for the installed frameworks and cache it"))
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
            from hvdp.horovod_build import command as build_command

            return build_command.main(args)
    except HvdpError as exc:
        print(f"hvdp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())

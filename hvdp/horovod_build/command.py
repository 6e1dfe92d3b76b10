"""``hvdp build`` as a command: its options and help text, and running it from parsed options.

The hvdp CLI gives ``add_arguments`` the ``build`` subparser and calls ``main`` with
what it parsed; every expected failure is a :class:`~hvdp.errors.BuildError` (one
clear message, exit status 2 from the CLI), never a traceback.
"""

from __future__ import annotations

import argparse
from typing import Any

from hvdp.errors import BuildError
from hvdp.frameworks import SPECS
from hvdp.horovod_build.build import build
from hvdp.horovod_build.options import BuildOptions
from hvdp.horovod_build.source import HOROVOD_VERSION

#: What ``hvdp build --help`` says above the options.
DESCRIPTION = f"""\
Build Horovod {HOROVOD_VERSION} from its PyPI source for the frameworks installed here
(with the changes current PyTorch and TensorFlow/Keras 3 need), cache the wheel
and install it. Compiling takes about 4-5 min on 2 cores; a second build with the
same inputs (frameworks, compiler, MPI, options) reuses the cached wheel in seconds."""
#: What ``hvdp build --help`` says below the options.
EPILOG = """examples:
  hvdp build                            for every framework installed, with MPI and Gloo
  hvdp build --frameworks torch -j 4    torch only, 4 compile jobs
  hvdp build --gpu                      with NCCL, for CUDA builds of the frameworks
  hvdp build --force                    compile again even when a cached wheel matches"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp build`` and its help text, on the CLI's subparser."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--frameworks", default=None,
                        help=f"comma-separated subset of {','.join(SPECS)} (default: all installed)")
    parser.add_argument("--gpu", action="store_true", help="build with NCCL for CUDA GPUs")
    parser.add_argument("--xla", action="store_true", help="also compile TensorFlow's XLA ops")
    parser.add_argument("--no-mpi", action="store_true", help="build with Gloo only")
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached wheel matches")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")


def options_from(args: Any) -> BuildOptions:
    """The :class:`BuildOptions` for parsed ``args``; BuildError for a bad ``--jobs``.

    Example:
        >>> options_from(argparse.Namespace(frameworks="torch, ", gpu=False, xla=False, no_mpi=True,
        ...                                 force=False, jobs=2))
        BuildOptions(frameworks=['torch'], gpu=False, xla=False, mpi=False, force=False, jobs=2)
    """
    options = BuildOptions(
        frameworks=[f.strip() for f in args.frameworks.split(",") if f.strip()] if args.frameworks else None,
        gpu=args.gpu, xla=args.xla, mpi=not args.no_mpi, force=args.force,
    )
    if args.jobs is not None:
        if args.jobs < 1:
            raise BuildError(f"--jobs {args.jobs} must be at least 1 (the number of parallel "
                             "compile jobs); leave it out to use every core.")
        options.jobs = args.jobs
    return options


def main(args: argparse.Namespace) -> int:
    """Run ``hvdp build`` for parsed ``args``, printing progress; 0 once Horovod is installed."""
    build(options_from(args), progress=lambda line: print(line, flush=True))
    return 0

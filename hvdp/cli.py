"""The ``hvdp`` command: ``run``, ``doctor``, ``report``, ``bench`` and ``build``.

Every command is a module with ``add_arguments(parser)`` (its options and help, on
its subparser) and ``main(args) -> int``; this module only lists them and dispatches.
Only the chosen command's module is imported, so ``hvdp --help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Tuple

from hvdp.errors import HvdpError

#: Every command: its name, the module that implements it, and its line in ``hvdp --help``.
COMMANDS: Tuple[Tuple[str, str, str], ...] = (
    ("run", "hvdp.launch", "launch a training script on N processes (see hvdp run --help)"),
    ("doctor", "hvdp.doctor", "show versions, what Horovod was built with, and problems"),
    ("report", "hvdp.report", "per-rank step times and why ranks wait (from hvdp run --profile DIR)"),
    ("bench", "hvdp.bench", "hvdp vs plain Horovod, DDP, MultiWorkerMirroredStrategy and mpi4py, "
                            "side by side (see hvdp bench --help)"),
    ("build", "hvdp.horovod_build.command", "build Horovod 0.28.1 for the installed frameworks and cache it"),
)


def _parser(chosen: Optional[str]) -> argparse.ArgumentParser:
    """The ``hvdp`` parser: a line per command, and the options of the ``chosen`` one (its module imported)."""
    from hvdp import __version__

    parser = argparse.ArgumentParser(
        prog="hvdp", description="Data-parallel training over Horovod, for PyTorch and TensorFlow.")
    parser.add_argument("--version", action="version", version=f"hvdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_path, help_line in COMMANDS:
        command_parser = sub.add_parser(name, help=help_line)
        if name == chosen:
            module = importlib.import_module(module_path)
            module.add_arguments(command_parser)
            command_parser.set_defaults(command_main=module.main)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hvdp`` console script."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        # The command is the first word: hvdp's own options (--help, --version) end the parse before it.
        args = _parser(args_in[0] if args_in else None).parse_args(args_in)
        return int(args.command_main(args))
    except HvdpError as exc:
        print(f"hvdp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

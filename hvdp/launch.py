"""``hvdp run``: a pure command builder over ``horovodrun``, plus a thin exec.

:func:`parse_run_args` turns ``hvdp run`` arguments into :class:`RunArgs`;
:func:`build_command` turns those into ``(argv, env)`` without starting anything,
so tests can check the command; :func:`run` starts it. hvdp's own flags are
few; every other flag before the command goes to horovodrun unchanged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from hvdp import _framework
from hvdp.errors import FrameworkError, LaunchError

USAGE = """usage: hvdp run -np N [--framework torch|tensorflow] [--gloo | --mpi]
                [-H HOSTS | --hostfile FILE] [--dry-run] [horovodrun options] COMMAND ...

Runs COMMAND (a .py file is run with this Python) on N processes through horovodrun.

  -np, --num-proc N     number of processes
  --framework NAME      torch or tensorflow: hvdp.init() in every process uses it,
                        and Keras 3 models run on the same backend (KERAS_BACKEND)
  --gloo | --mpi        the controller (default: gloo, the faster one on CPU here)
  -H, --hosts HOSTS     e.g. host1:2,host2:2 (default: localhost:N)
  --hostfile FILE       one 'host slots=N' per line
  --dry-run             print the command and the environment hvdp sets, run nothing

Defaults hvdp sets when you have not: OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS and
TF_NUM_INTEROP_THREADS so that local processes share the cores instead of
oversubscribing them. Any other option before COMMAND is passed to horovodrun
(see horovodrun --help)."""

#: Thread settings hvdp fills in when unset (local runs only).
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")


@dataclass
class RunArgs:
    """The parsed ``hvdp run`` command line."""

    num_proc: int
    command: List[str]
    framework: Optional[str] = None
    controller: str = "gloo"
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    dry_run: bool = False
    passthrough: List[str] = field(default_factory=list)


def horovodrun_arity() -> Dict[str, int]:
    """How many values each horovodrun option takes, read from horovodrun's own parser."""
    try:
        from horovod.runner import launch as horovod_launch
    except ImportError as exc:
        raise LaunchError("Horovod is not installed here, so hvdp run cannot start a job. "
                          "Build and install it: hvdp build.") from exc

    class _CapturedParserError(Exception):
        def __init__(self, parser: argparse.ArgumentParser) -> None:
            super().__init__()
            self.parser = parser

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _CapturedParserError(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[assignment]
    try:
        horovod_launch.parse_args()
    except _CapturedParserError as captured:
        parser = captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    arity: Dict[str, int] = {}
    for action in parser._actions:
        count = 0 if action.nargs == 0 else action.nargs if isinstance(action.nargs, int) else 1
        for option in action.option_strings:
            arity[option] = count
    return arity


def _value(argv: List[str], i: int, flag: str) -> str:
    if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
        raise LaunchError(f"hvdp run: {flag} needs a value. See hvdp run --help.")
    return argv[i + 1]


def parse_run_args(argv: List[str], arity: Optional[Dict[str, int]] = None) -> RunArgs:
    """Parse ``hvdp run`` arguments (everything after ``run``).

    Example:
        >>> parse_run_args(["-np", "2", "--framework", "torch", "train.py"], arity={}).framework
        'torch'
    """
    num_proc: Optional[int] = None
    framework = hosts = hostfile = None
    controller: Optional[str] = None
    dry_run = False
    passthrough: List[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, _, inline = token.partition("=")
        if token == "--":
            i += 1
            break
        if not token.startswith("-"):
            break
        if token in ("-h", "--help"):
            raise SystemExit(print(USAGE) or 0)
        if flag in ("-np", "--num-proc", "-n"):
            raw = inline or _value(argv, i, flag)
            try:
                num_proc = int(raw)
            except ValueError:
                raise LaunchError(
                    f"hvdp run: -np {raw!r} is not a number; give the process count, e.g. -np 2.") from None
            i += 1 if inline else 2
        elif flag == "--framework":
            framework = inline or _value(argv, i, flag)
            i += 1 if inline else 2
        elif flag in ("-H", "--hosts"):
            hosts = inline or _value(argv, i, flag)
            i += 1 if inline else 2
        elif flag == "--hostfile":
            hostfile = inline or _value(argv, i, flag)
            i += 1 if inline else 2
        elif token in ("--gloo", "--mpi"):
            if controller and controller != token[2:]:
                raise LaunchError("hvdp run: --gloo and --mpi both given; choose one controller.")
            controller = token[2:]
            i += 1
        elif token == "--dry-run":
            dry_run = True
            i += 1
        else:
            table = horovodrun_arity() if arity is None else arity
            if flag not in table:
                raise LaunchError(f"hvdp run: unknown option {flag!r}: not an hvdp run option nor a "
                                  f"horovodrun option. See hvdp run --help and horovodrun --help.")
            take = 0 if inline else table[flag]
            passthrough += argv[i:i + 1 + take]
            i += 1 + take
    command = argv[i:]
    if num_proc is None:
        raise LaunchError("hvdp run: -np is required (the number of processes), e.g. hvdp run -np 2 train.py.")
    if num_proc < 1:
        raise LaunchError(f"hvdp run: -np {num_proc} must be at least 1.")
    if not command:
        raise LaunchError("hvdp run: no command given; e.g. hvdp run -np 2 examples/train_digits.py.")
    if framework is not None:
        try:
            _framework.check_name(framework, "hvdp run --framework")
        except FrameworkError as exc:
            raise LaunchError(str(exc)) from None
    if hosts and hostfile:
        raise LaunchError("hvdp run: give -H/--hosts or --hostfile, not both.")
    return RunArgs(num_proc=num_proc, command=command, framework=framework,
                   controller=controller or "gloo", hosts=hosts, hostfile=hostfile,
                   dry_run=dry_run, passthrough=passthrough)


def horovodrun_path() -> str:
    """The horovodrun of this Python's environment."""
    beside = Path(sys.executable).parent / "horovodrun"
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not found:
        raise LaunchError("horovodrun not found: Horovod is not installed here. Run: hvdp build.")
    return found


def build_command(args: RunArgs, environ: Mapping[str, str], cpu_count: int,
                  horovodrun: str = "horovodrun") -> Tuple[List[str], Dict[str, str]]:
    """The horovodrun argv and the environment variables hvdp sets for the job.

    Example:
        >>> argv, env = build_command(RunArgs(num_proc=2, command=["t.py"], framework="torch"), {}, 2)
        >>> env["HVDP_FRAMEWORK"], argv[:3]
        ('torch', ['horovodrun', '-np', '2'])
    """
    env: Dict[str, str] = {}
    if args.framework:
        for var, label in ((_framework.ENV_VAR, "HVDP_FRAMEWORK"), ("KERAS_BACKEND", "KERAS_BACKEND")):
            current = environ.get(var)
            if current and current != args.framework:
                raise LaunchError(
                    f"hvdp run --framework {args.framework} contradicts {label}={current} in your "
                    f"environment. Unset {label} or make the two agree."
                )
            env[var] = args.framework
    if args.controller == "mpi" and not shutil.which("mpirun", path=environ.get("PATH")):
        raise LaunchError("hvdp run --mpi: mpirun not found. Fix: apt-get install -y openmpi-bin "
                          "libopenmpi-dev, or use --gloo.")
    if not args.hosts and not args.hostfile:
        threads = str(max(1, cpu_count // args.num_proc))
        for var in THREAD_VARS:
            if var not in environ:
                env[var] = threads
        if "TF_NUM_INTEROP_THREADS" not in environ:
            env["TF_NUM_INTEROP_THREADS"] = "1"
    argv = [horovodrun, "-np", str(args.num_proc), f"--{args.controller}"]
    if args.hosts:
        argv += ["-H", args.hosts]
    if args.hostfile:
        argv += ["--hostfile", args.hostfile]
    argv += args.passthrough
    command = list(args.command)
    if command[0].endswith(".py"):
        if not Path(command[0]).exists():
            raise LaunchError(f"hvdp run: script {command[0]!r} not found (working directory {os.getcwd()}).")
        command.insert(0, sys.executable)
    return argv + command, env


def run(argv: List[str]) -> int:
    """Parse, build and start the job; return its exit code."""
    import subprocess

    args = parse_run_args(argv)
    command, env = build_command(args, os.environ, os.cpu_count() or 1, horovodrun_path())
    if args.dry_run:
        for key, value in sorted(env.items()):
            print(f"{key}={value}")
        print(" ".join(command))
        return 0
    return subprocess.call(command, env={**os.environ, **env})

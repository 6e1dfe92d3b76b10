"""The pure command builder: :func:`build_command` turns :class:`RunArgs` into ``(argv, env)``.

Nothing is started here, so tests check the command without processes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from hvdp import _runtime
from hvdp.errors import LaunchError
from hvdp.launch import defaults, worker
from hvdp.launch.args import DEFAULT_ELASTIC_TIMEOUT, RunArgs
from hvdp.launch.hosts import Hosts, discovery_script_path, find_hosts, host_sources

#: Thread settings hvdp fills in when unset (local runs only).
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")


def horovodrun_path() -> str:
    """The horovodrun of this Python's environment."""
    beside = Path(sys.executable).parent / "horovodrun"
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not found:
        raise LaunchError("horovodrun not found: Horovod is not installed here. Run: hvdp build.")
    return found


def resolve_hosts(args: RunArgs, environ: Mapping[str, str]) -> Tuple[Optional[Hosts], str]:
    """The job's hosts and slots, and where they came from: -H, --hostfile, the Slurm allocation, or none."""
    return find_hosts(host_sources(args.hosts, args.hostfile, args.discovery_script if args.elastic else None),
                      environ)


def framework_env(framework: str, environ: Mapping[str, str], source: str) -> Dict[str, str]:
    """``HVDP_FRAMEWORK`` and ``KERAS_BACKEND`` for every rank; a value ``environ`` already holds that
    differs is refused, naming ``source`` (what asked for ``framework``).

    Example:
        >>> framework_env("torch", {}, "hvdp run --framework torch")
        {'HVDP_FRAMEWORK': 'torch', 'KERAS_BACKEND': 'torch'}
    """
    env: Dict[str, str] = {}
    for var in (_runtime.ENV_VAR, "KERAS_BACKEND"):
        current = environ.get(var)
        if current and current != framework:
            raise LaunchError(f"{source} contradicts {var}={current} in your environment. "
                              f"Unset {var} or make the two agree.")
        env[var] = framework
    return env


def thread_env(threads: int, environ: Mapping[str, str]) -> Dict[str, str]:
    """The thread settings for a rank of ``threads`` cores, leaving out those ``environ`` sets.

    Example:
        >>> sorted(thread_env(2, {"OMP_NUM_THREADS": "4"}).items())
        [('TF_NUM_INTEROP_THREADS', '1'), ('TF_NUM_INTRAOP_THREADS', '2')]
    """
    env = {var: str(threads) for var in THREAD_VARS if var not in environ}
    if "TF_NUM_INTEROP_THREADS" not in environ:
        env["TF_NUM_INTEROP_THREADS"] = "1"
    return env


def stall_env(stall_timeout: int, environ: Mapping[str, str]) -> Dict[str, str]:
    """Horovod's stall inspector set to end a job ``stall_timeout`` seconds into a stall (0: never),
    unless ``environ`` sets it already.

    Example:
        >>> stall_env(10, {})
        {'HOROVOD_STALL_CHECK_TIME_SECONDS': '2', 'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '10'}
    """
    if stall_timeout == 0:
        return {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    if "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in environ:
        return {}
    # Horovod checks every CHECK seconds and ends the job at the first check past SHUTDOWN.
    return {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, min(60, stall_timeout // 5))),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(stall_timeout)}


def build_command(args: RunArgs, environ: Mapping[str, str], cpu_count: int,
                  horovodrun: str = "horovodrun") -> Tuple[List[str], Dict[str, str]]:
    """The horovodrun argv and the environment variables hvdp sets for the job.

    Hosts come from ``-H``, else ``--hostfile``, else the Slurm allocation in
    ``environ`` (``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE``); ``-np``
    defaults to their slots. With no hosts the job is local.

    Example:
        >>> argv, env = build_command(RunArgs(num_proc=2, command=["python", "t.py"], framework="torch"), {}, 2)
        >>> env["HVDP_FRAMEWORK"], argv[:3]
        ('torch', ['horovodrun', '-np', '2'])
    """
    env: Dict[str, str] = {}
    if args.framework:
        env.update(framework_env(args.framework, environ, f"hvdp run --framework {args.framework}"))
    if args.controller == "mpi" and not shutil.which("mpirun", path=environ.get("PATH")):
        raise LaunchError("hvdp run --mpi: mpirun not found. Fix: apt-get install -y openmpi-bin "
                          "libopenmpi-dev, or use --gloo.")
    # An elastic job's hosts come from its discovery script while it runs, not from -H or Slurm.
    hosts, origin = (None, "") if args.elastic else resolve_hosts(args, environ)
    num_proc = args.num_proc if args.num_proc is not None or not args.elastic else args.min_np
    if hosts is None:
        if num_proc is None:
            raise LaunchError("hvdp run: -np is required (the number of processes), e.g. hvdp run -np 2 train.py.")
        # An elastic job may grow to --max-np processes: split the cores among that many.
        threads = str(max(1, cpu_count // max(num_proc, args.max_np or 0)))
    else:
        slots = sum(count for _, count in hosts)
        num_proc = slots if num_proc is None else num_proc
        if num_proc > slots:
            raise LaunchError(f"hvdp run: -np {num_proc} but the hosts from {origin} have {slots} slots "
                              f"({_hosts_arg(hosts)}); lower -np or give the hosts more slots (HOST:SLOTS).")
        # Remote hosts' cores are unknown, except in a Slurm allocation that says how many each task has.
        threads = environ.get("SLURM_CPUS_PER_TASK", "") if origin == "the Slurm allocation" else ""
    if threads.isdigit() and int(threads) > 0:
        env.update(thread_env(int(threads), environ))
    env.update(defaults.horovod_defaults(args.controller, args.framework, hosts is None, environ))
    if args.profile:
        env["HVDP_PROFILE_DIR"] = str(Path(args.profile).expanduser().absolute())
    if args.timeline:
        env["HOROVOD_TIMELINE"] = str(Path(args.timeline).expanduser().absolute())
    env.update(stall_env(args.stall_timeout, environ))
    argv = [horovodrun, "-np", str(num_proc), f"--{args.controller}"]
    if hosts is not None:
        argv += ["-H", _hosts_arg(hosts)]
    if args.ssh_port is not None:
        argv += ["--ssh-port", str(args.ssh_port)]
    if args.ssh_identity_file:
        key = Path(args.ssh_identity_file).expanduser()
        if not key.is_file():
            raise LaunchError(f"hvdp run: --ssh-identity-file {args.ssh_identity_file!r} not found. Give the "
                              f"private key whose public half is in the hosts' authorized_keys "
                              f"(ssh-keygen -t ed25519 makes a pair).")
        argv += ["--ssh-identity-file", str(key.absolute())]
    for nic in args.network_interfaces:
        argv += ["--network-interface", nic]
    if args.elastic:
        argv += _elastic_flags(args)
    argv += args.passthrough
    command = list(args.command)
    if command[0].endswith(".py"):
        if not Path(command[0]).exists():
            raise LaunchError(f"hvdp run: script {command[0]!r} not found (working directory {os.getcwd()}).")
        command.insert(0, sys.executable)
    return argv + command, env


def _elastic_flags(args: RunArgs) -> List[str]:
    """horovodrun's flags for an elastic job: the discovery script (absolute) and the process range."""
    script = discovery_script_path(args.discovery_script or "")
    # Horovod hands the path to a shell as it is: quote it.
    flags = ["--host-discovery-script", shlex.quote(str(script)), "--min-np", str(args.min_np)]
    if args.max_np is not None:
        flags += ["--max-np", str(args.max_np)]
    if not any(item.partition("=")[0] == "--slots-per-host" for item in args.passthrough):
        flags += ["--slots-per-host", "1"]  # a HOST line without :SLOTS has one slot
    flags += ["--elastic-timeout", str(args.elastic_timeout or DEFAULT_ELASTIC_TIMEOUT)]
    return flags


def _hosts_arg(hosts: List[Tuple[str, int]]) -> str:
    return ",".join(f"{name}:{count}" for name, count in hosts)



def in_process(argv: List[str], python: str = sys.executable) -> List[str]:
    """``argv`` with horovodrun started as ``python -m hvdp.launch.horovodrun``: the same command line,
    its build checks answered once per Horovod install (:mod:`hvdp.launch.horovodrun`).

    Example:
        >>> in_process(["/venv/bin/horovodrun", "-np", "2", "--gloo", "python", "t.py"], "python")
        ['python', '-m', 'hvdp.launch.horovodrun', '-np', '2', '--gloo', 'python', 't.py']
    """
    if not argv or os.path.basename(argv[0]) != "horovodrun":
        return argv
    return [python, "-m", "hvdp.launch.horovodrun", *argv[1:]]


def with_bootstrap(argv: List[str], args: RunArgs, python: str = sys.executable) -> List[str]:
    """``argv`` (from :func:`build_command`) with the user's command started through the rank bootstrap
    (:mod:`hvdp.launch.worker`), which sends each rank's output and failure record to ``hvdp run``.

    Example:
        >>> args = RunArgs(num_proc=2, command=["t.py", "--lr", "1"])
        >>> argv = with_bootstrap(["horovodrun", "-np", "2", "--gloo", "python", "t.py", "--lr", "1"], args, "python")
        >>> argv[4:6], argv[6:]
        (['python', '.../hvdp/launch/worker.py'], ['python', 't.py', '--lr', '1'])
    """
    tail = len(args.command) + (1 if args.command[0].endswith(".py") else 0)  # the Python build_command added
    return argv[:-tail] + worker.wrap(argv[-tail:], python)

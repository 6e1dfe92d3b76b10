"""``hvdp run``: a pure command builder over ``horovodrun``, plus a thin exec.

:func:`parse_run_args` turns ``hvdp run`` arguments into :class:`RunArgs`;
:func:`build_command` turns those into ``(argv, env)`` without starting anything,
so tests can check the command; :func:`run` starts it. hvdp's own flags are
few; every other flag before the command goes to horovodrun unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from hvdp import _framework, tuning
from hvdp.errors import FrameworkError, LaunchError
from hvdp.supervise import JobWatcher, describe_exit  # noqa: F401 - part of this module's interface

USAGE = """usage: hvdp run [-np N] [--framework torch|tensorflow] [--gloo | --mpi]
                [-H HOSTS | --hostfile FILE] [-p PORT] [-i KEY] [--network-interface NIC]
                [--profile DIR] [--timeline FILE] [--stall-timeout SECONDS]
                [--elastic --host-discovery-script FILE [--min-np N] [--max-np M]]
                [--dry-run] [horovodrun options] COMMAND ...

Runs COMMAND (a .py file is run with this Python) on N processes through horovodrun.

  -np, --num-proc N     number of processes (inside a Slurm allocation: default, all its tasks)
  --framework NAME      torch or tensorflow: hvdp.init() in every process uses it,
                        and Keras 3 models run on the same backend (KERAS_BACKEND)
  --gloo | --mpi        the controller (default: gloo, the faster one on CPU here)
  -H, --hosts HOSTS     e.g. host1:2,host2:2 (default: localhost:N, or inside a Slurm
                        allocation its nodes and tasks per node)
  --hostfile FILE       one 'host slots=N' (or 'host:N', or 'host' for 1 slot) per line; # comments
  -p, --ssh-port PORT   ssh port of every host (default: ssh's own, 22)
  -i, --ssh-identity-file KEY
                        private key ssh uses to reach the hosts
  --network-interface NIC
                        the interface ranks talk over, e.g. eth0 (repeat, or a,b, for several;
                        default: horovodrun finds the interfaces common to all hosts)
  --profile DIR         record hvdp.profiler steps of every rank in DIR (then: hvdp report DIR)
  --timeline FILE       write Horovod's timeline of the run to FILE (chrome://tracing format)
  --stall-timeout S     end the job when a rank has not joined a collective for S seconds
                        (default 300; Horovod's stall inspector names the missing ranks and
                        tensors, under Gloo and MPI; 0 turns it off)
  --elastic             elastic training (hvdp.elastic): workers may fail, leave and join while
                        the job runs; needs Gloo (not --mpi) and a discovery script
  --host-discovery-script FILE
                        an executable that prints the hosts available now, one 'HOST:SLOTS'
                        (or 'HOST', 1 slot unless --slots-per-host) per line; run every second
  --min-np N            train while at least N processes are up (default: -np)
  --elastic-timeout S   end an elastic job that has waited S seconds for --min-np processes
                        (default 120; meanwhile hvdp run says what it waits for)
  --max-np M            never start more than M processes (default: as many as there are slots)
                        (-np, default --min-np, is the number to start with)
  --dry-run             print the command and the environment hvdp sets, run nothing

When a rank dies or stalls, every other rank is stopped and hvdp run exits non-zero
with a line naming the failed rank(s). SIGTERM, SIGINT (Ctrl-C) or SIGHUP to hvdp run
end every process of the job (SIGKILL after 5 s) and hvdp run exits 128 + the signal.

Defaults hvdp sets when you have not: OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS and
TF_NUM_INTEROP_THREADS so that local processes share the cores instead of
oversubscribing them (in a Slurm allocation: SLURM_CPUS_PER_TASK threads); for local
jobs, HOROVOD_CYCLE_TIME=5 and, under --mpi, OMPI_MCA_mpi_yield_when_idle=1 (measured
by hvdp bench; see hvdp/tuning.py). Any other
option before COMMAND is passed to horovodrun (see horovodrun --help)."""

#: Seconds a rank may stay out of a collective before the job is ended (``--stall-timeout``).
DEFAULT_STALL_TIMEOUT = 300
#: Seconds an elastic job waits for --min-np usable slots before it ends (``--elastic-timeout``).
#: Horovod's own default, 600 s, leaves a job that lost its workers silent for ten minutes;
#: 120 s covers a blacklist cooldown and a replacement host's start with a wide margin
#: (measured here: a host listed again runs its new worker 6-15 s later).
DEFAULT_ELASTIC_TIMEOUT = 120
#: Thread settings hvdp fills in when unset (local runs only).
THREAD_VARS = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")


@dataclass
class RunArgs:
    """The parsed ``hvdp run`` command line."""

    num_proc: Optional[int]
    command: List[str]
    framework: Optional[str] = None
    controller: str = "gloo"
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    network_interfaces: List[str] = field(default_factory=list)
    dry_run: bool = False
    passthrough: List[str] = field(default_factory=list)
    profile: Optional[str] = None
    timeline: Optional[str] = None
    stall_timeout: int = DEFAULT_STALL_TIMEOUT
    elastic: bool = False
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    discovery_script: Optional[str] = None
    elastic_timeout: Optional[int] = None


#: A host name or IPv4 address as horovodrun accepts it.
_HOST = re.compile(r"^[\w.-]+$")
#: A network interface name (Linux allows at most 15 characters).
_NIC = re.compile(r"^[\w.:@-]{1,15}$")


def _host_slots(item: str) -> Optional[Tuple[str, int]]:
    """``HOST`` or ``HOST:SLOTS`` as (host, slots), a host without ``:SLOTS`` having one; None if malformed."""
    name, colon, slots = item.strip().partition(":")
    if not _HOST.match(name) or (colon and not slots.isdigit()):
        return None
    return name, int(slots) if colon else 1


def parse_hosts(hosts: str, origin: str = "-H") -> List[Tuple[str, int]]:
    """``host1:2,host2`` as ``[("host1", 2), ("host2", 1)]``: a host without ``:N`` has one slot.

    Example:
        >>> parse_hosts("node1:2,node2")
        [('node1', 2), ('node2', 1)]
    """
    parsed: List[Tuple[str, int]] = []
    for item in hosts.split(","):
        host = _host_slots(item)
        if host is None:
            raise LaunchError(f"hvdp run: {origin} {hosts!r}: {item.strip()!r} is not HOST or HOST:SLOTS; "
                              f"write e.g. -H host1:2,host2:2.")
        name, count = host
        if count < 1:
            raise LaunchError(f"hvdp run: {origin} {hosts!r}: {name} has {count} slots; give it at least 1.")
        if any(name == seen for seen, _ in parsed):
            raise LaunchError(f"hvdp run: {origin} {hosts!r} names {name} twice; give it once with the "
                              f"sum of its slots.")
        parsed.append((name, count))
    return parsed


def parse_hostfile(text: str, path: str = "hostfile") -> List[Tuple[str, int]]:
    """The hosts of a hostfile: ``host slots=N``, ``host:N`` or ``host`` per line, ``#`` comments.

    This is the format of Open MPI, horovodrun and the Kubeflow MPI Operator's ``/etc/mpi/hostfile``.

    Example:
        >>> parse_hostfile("# two nodes\\nnode1 slots=2\\nnode2:1\\n")
        [('node1', 2), ('node2', 1)]
    """
    items: List[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([\w.-]+)(?:\s+slots\s*=\s*(\d+)|:(\d+))?(?:\s+max[-_]slots\s*=\s*\d+)?", line)
        if not match:
            raise LaunchError(f"hvdp run: {path} line {number}: {raw.strip()!r} is not 'host slots=N' "
                              f"(or 'host:N', or 'host').")
        items.append(f"{match.group(1)}:{match.group(2) or match.group(3) or 1}")
    if not items:
        raise LaunchError(f"hvdp run: {path} lists no hosts; write one 'host slots=N' per line.")
    return parse_hosts(",".join(items), origin=f"hostfile {path}:")


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm host list (``SLURM_JOB_NODELIST``) into host names, in order.

    Ranges keep the zero padding of their first number; several bracket groups
    in one name expand to every combination.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    items: List[str] = []
    depth, current = 0, ""
    for char in nodelist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    if depth != 0 or not all(items):
        raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r} is not a Slurm host list "
                          f"(e.g. node[01-03,07],gpu5). Give the hosts with -H instead.")
    return [host for item in items for host in _expand_host(item, nodelist)]


def _expand_host(item: str, nodelist: str) -> List[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if not _HOST.match(item):
            raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r}: {item!r} is not a host name.")
        return [item]
    values: List[str] = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r}: [{match.group(1)}] is not a list "
                              f"of numbers and ranges like [01-03,07].")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)] if dash else [low]
    head, tail = item[:match.start()], item[match.end():]
    return [host for value in values for host in _expand_host(head + value + tail, nodelist)]


def expand_tasks_per_node(spec: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) into one task count per node.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: List[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise LaunchError(f"hvdp run: SLURM_TASKS_PER_NODE {spec!r} is not a Slurm task count list "
                              f"(e.g. 2(x3),1). Give the hosts with -H instead.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_hosts(environ: Mapping[str, str]) -> Optional[List[Tuple[str, int]]]:
    """The nodes and tasks per node of the Slurm allocation ``environ`` is in, or None outside one.

    Example:
        >>> slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"})
        [('n1', 2), ('n2', 2)]
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not environ.get("SLURM_JOB_ID") or not nodelist:
        return None
    nodes = expand_nodelist(nodelist)
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if not tasks:
        raise LaunchError(f"hvdp run: inside Slurm job {environ['SLURM_JOB_ID']} but SLURM_TASKS_PER_NODE is "
                          f"not set; ask Slurm for tasks (#SBATCH --ntasks-per-node=N) or give -H.")
    counts = expand_tasks_per_node(tasks)
    if len(counts) != len(nodes):
        raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r} has {len(nodes)} nodes but "
                          f"SLURM_TASKS_PER_NODE {tasks!r} gives {len(counts)} counts; give the hosts with -H.")
    return list(zip(nodes, counts))


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
    framework = hosts = hostfile = identity = None
    ssh_port: Optional[int] = None
    nics: List[str] = []
    controller: Optional[str] = None
    dry_run = False
    passthrough: List[str] = []
    profile = timeline = None
    stall_timeout = DEFAULT_STALL_TIMEOUT
    elastic = False
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    discovery_script: Optional[str] = None
    elastic_timeout: Optional[int] = None
    i = 0
    flag = inline = ""

    def take() -> str:
        """The current flag's value (``--flag=V`` or ``--flag V``), moving past both."""
        nonlocal i
        value = inline or _value(argv, i, flag)
        i += 1 if inline else 2
        return value

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
            raw = take()
            try:
                num_proc = int(raw)
            except ValueError:
                raise LaunchError(
                    f"hvdp run: -np {raw!r} is not a number; give the process count, e.g. -np 2.") from None
        elif flag == "--framework":
            framework = take()
        elif flag in ("-H", "--hosts"):
            hosts = take()
        elif flag in ("--hostfile", "-hostfile"):
            hostfile = take()
        elif flag in ("-p", "--ssh-port"):
            raw = take()
            if not raw.isdigit() or not 1 <= int(raw) <= 65535:
                raise LaunchError(f"hvdp run: {flag} {raw!r} is not a port number (1-65535); "
                                  f"e.g. --ssh-port 2222.")
            ssh_port = int(raw)
        elif flag in ("-i", "--ssh-identity-file"):
            identity = take()
        elif flag in ("--network-interface", "--network-interfaces"):
            raw = take()
            for nic in raw.split(","):
                if not _NIC.match(nic.strip()):
                    raise LaunchError(f"hvdp run: {flag} {raw!r}: {nic.strip()!r} is not a network interface "
                                      f"name; e.g. --network-interface eth0 (ip -br link lists them).")
                if nic.strip() not in nics:
                    nics.append(nic.strip())
        elif token in ("--gloo", "--mpi"):
            if controller and controller != token[2:]:
                raise LaunchError("hvdp run: --gloo and --mpi both given; choose one controller.")
            controller = token[2:]
            i += 1
        elif token == "--dry-run":
            dry_run = True
            i += 1
        elif flag == "--profile":
            profile = take()
        elif flag == "--timeline":
            timeline = take()
        elif flag == "--stall-timeout":
            raw = take()
            if not raw.isdigit():
                raise LaunchError(f"hvdp run: --stall-timeout {raw!r} is not a whole number of seconds; "
                                  f"e.g. --stall-timeout 120 (0 turns the check off).")
            stall_timeout = int(raw)
        elif token == "--elastic":
            elastic = True
            i += 1
        elif flag in ("--min-np", "--min-num-proc", "--max-np", "--max-num-proc"):
            raw = take()
            if not raw.isdigit() or int(raw) < 1:
                raise LaunchError(f"hvdp run: {flag} {raw!r} is not a process count; give a whole number "
                                  f"of at least 1, e.g. {flag} 2.")
            if flag.startswith("--min"):
                min_np = int(raw)
            else:
                max_np = int(raw)
        elif flag == "--host-discovery-script":
            discovery_script = take()
        elif flag == "--elastic-timeout":
            raw = take()
            if not raw.isdigit() or int(raw) < 1:
                raise LaunchError(f"hvdp run: --elastic-timeout {raw!r} is not a whole number of seconds "
                                  f"(at least 1); e.g. --elastic-timeout {DEFAULT_ELASTIC_TIMEOUT}.")
            elastic_timeout = int(raw)
        else:
            table = horovodrun_arity() if arity is None else arity
            if flag not in table:
                raise LaunchError(f"hvdp run: unknown option {flag!r}: not an hvdp run option nor a "
                                  f"horovodrun option. See hvdp run --help and horovodrun --help.")
            count = 0 if inline else table[flag]
            passthrough += argv[i:i + 1 + count]
            i += 1 + count
    command = argv[i:]
    if num_proc is not None and num_proc < 1:
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
    if hosts:
        parse_hosts(hosts)
    if elastic_timeout is not None and not elastic:
        raise LaunchError("hvdp run: --elastic-timeout only applies to elastic jobs; add --elastic "
                          "(hvdp run --elastic --host-discovery-script FILE ...).")
    if elastic or min_np is not None or max_np is not None or discovery_script is not None:
        min_np, max_np = check_elastic_args(elastic, num_proc, min_np, max_np, discovery_script,
                                            controller, hosts or hostfile)
    return RunArgs(num_proc=num_proc, command=command, framework=framework,
                   controller=controller or "gloo", hosts=hosts, hostfile=hostfile,
                   ssh_port=ssh_port, ssh_identity_file=identity, network_interfaces=nics,
                   dry_run=dry_run, passthrough=passthrough, profile=profile, timeline=timeline,
                   stall_timeout=stall_timeout, elastic=elastic, min_np=min_np, max_np=max_np,
                   discovery_script=discovery_script,
                   elastic_timeout=(elastic_timeout or DEFAULT_ELASTIC_TIMEOUT) if elastic else None)


def check_elastic_args(elastic: bool, num_proc: Optional[int], min_np: Optional[int], max_np: Optional[int],
                       discovery_script: Optional[str], controller: Optional[str],
                       hosts: Optional[str]) -> Tuple[int, Optional[int]]:
    """Check the elastic options together; return (min-np, max-np) with min-np defaulting to -np.

    Example:
        >>> check_elastic_args(True, 2, None, 4, "discover.sh", None, None)
        (2, 4)
    """
    if not elastic:
        given = "--host-discovery-script" if discovery_script is not None else \
            "--min-np" if min_np is not None else "--max-np"
        raise LaunchError(f"hvdp run: {given} only applies to elastic jobs; add --elastic "
                          f"(hvdp run --elastic --host-discovery-script FILE ...).")
    if controller == "mpi":
        raise LaunchError("hvdp run: --elastic needs the Gloo controller (Horovod runs elastic jobs on Gloo "
                          "only), but --mpi was given. Drop --mpi (or use --gloo).")
    if hosts:
        raise LaunchError("hvdp run: --elastic takes its hosts from --host-discovery-script, not -H or "
                          "--hostfile; list the hosts in the discovery script's output instead.")
    if discovery_script is None:
        raise LaunchError("hvdp run: --elastic needs --host-discovery-script FILE: an executable that prints "
                          "the available hosts, one HOST:SLOTS per line (e.g. echo localhost:2).")
    origin = "--min-np"
    if min_np is None:
        min_np, origin = num_proc, "-np"
    if min_np is None:
        raise LaunchError("hvdp run: --elastic needs --min-np N (or -np N): the fewest processes to train "
                          "with, e.g. --min-np 1 --max-np 4.")
    if max_np is not None and min_np > max_np:
        raise LaunchError(f"hvdp run: {origin} {min_np} is greater than --max-np {max_np}"
                          f"{' (-np is the --min-np when --min-np is not given)' if origin == '-np' else ''}; "
                          f"the job could never run. Give --min-np <= --max-np, e.g. --min-np {max_np} "
                          f"--max-np {max_np} or --min-np {min_np} --max-np {min_np}.")
    if num_proc is not None and (num_proc < min_np or (max_np is not None and num_proc > max_np)):
        allowed = f"{min_np}..{max_np}" if max_np is not None else f"at least {min_np}"
        raise LaunchError(f"hvdp run: -np {num_proc} is outside --min-np {min_np} and --max-np "
                          f"{max_np if max_np is not None else '(unbounded)'}; the job starts with -np "
                          f"processes, so give -np {allowed} (or leave -np out to start with --min-np).")
    return min_np, max_np


def discovery_script_path(path: str) -> Path:
    """The absolute path of the host discovery script; LaunchError if it is missing or not executable.

    Example:
        >>> discovery_script_path("/bin/true").name
        'true'
    """
    script = Path(path).expanduser()
    if not script.is_file():
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} not found (working directory "
                          f"{os.getcwd()}). Give the path of an executable that prints one HOST:SLOTS per line.")
    if not os.access(script, os.X_OK):
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} is not executable; Horovod runs it "
                          f"directly. Fix: chmod +x {path} (and start it with a #! line, e.g. #!/bin/sh).")
    return script.absolute()


def check_discovery_script(path: str, timeout_s: float = 30.0) -> List[Tuple[str, int]]:
    """Run the host discovery script once and check what it prints: ``HOST`` or ``HOST:SLOTS`` per line.

    A line without slots counts as 1 slot here (``--slots-per-host`` changes that in the job).

    Returns:
        The hosts and slots the script lists now.

    Raises:
        LaunchError: the script is missing, not executable, fails, hangs, or prints a line
            that is not ``HOST`` or ``HOST:SLOTS``; the message names the script and the line.

    Example:
        >>> check_discovery_script("./discover_hosts.sh")  # doctest: +SKIP
        [('localhost', 2)]
    """
    import subprocess

    script = discovery_script_path(path)
    # Through the shell, as Horovod runs it; in its own process group, so a hung script ends with its children.
    with subprocess.Popen(shlex.quote(str(script)), shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace", start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise LaunchError(f"hvdp run: --host-discovery-script {path!r} did not finish in {timeout_s:g} s; "
                              f"Horovod runs it every second, so it must print the hosts and exit quickly.") from None
    if process.returncode != 0:
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no error output"
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} exited with status {process.returncode} "
                          f"({detail}); it must exit 0 after printing one HOST:SLOTS per line.")
    found: List[Tuple[str, int]] = []
    for number, raw in enumerate(stdout.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host = _host_slots(line)
        if host is None:
            raise LaunchError(f"hvdp run: --host-discovery-script {path!r} printed {raw!r} on line {number}, "
                              f"which is not HOST or HOST:SLOTS (e.g. node1:2). Make it print only host lines "
                              f"(send anything else to stderr).")
        found.append(host)
    return found


def horovodrun_path() -> str:
    """The horovodrun of this Python's environment."""
    beside = Path(sys.executable).parent / "horovodrun"
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not found:
        raise LaunchError("horovodrun not found: Horovod is not installed here. Run: hvdp build.")
    return found


def resolve_hosts(args: RunArgs, environ: Mapping[str, str]) -> Tuple[Optional[List[Tuple[str, int]]], str]:
    """The job's hosts and slots, and where they came from: -H, --hostfile, the Slurm allocation, or none."""
    if args.hosts:
        return parse_hosts(args.hosts), "-H"
    if args.hostfile:
        path = Path(args.hostfile).expanduser()
        if not path.is_file():
            raise LaunchError(f"hvdp run: --hostfile {args.hostfile!r} not found (working directory {os.getcwd()}).")
        return parse_hostfile(path.read_text(), args.hostfile), "--hostfile"
    allocation = slurm_hosts(environ)
    if allocation is not None:
        return allocation, "the Slurm allocation"
    return None, ""


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
        for var in THREAD_VARS:
            if var not in environ:
                env[var] = threads
        if "TF_NUM_INTEROP_THREADS" not in environ:
            env["TF_NUM_INTEROP_THREADS"] = "1"
    env.update(tuning.horovod_defaults(args.controller, args.framework, hosts is None, environ))
    if args.profile:
        env["HVDP_PROFILE_DIR"] = str(Path(args.profile).expanduser().absolute())
    if args.timeline:
        env["HOROVOD_TIMELINE"] = str(Path(args.timeline).expanduser().absolute())
    if args.stall_timeout == 0:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    elif "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in environ:
        # Horovod checks every CHECK seconds and ends the job at the first check past SHUTDOWN.
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(max(1, min(60, args.stall_timeout // 5)))
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_timeout)
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


def run(argv: List[str]) -> int:
    """Parse, build and start the job; return its exit code (non-zero, with a summary, on failure).

    The job runs under :func:`hvdp.supervise.supervise`: its output is relayed, a failure is
    summed up in one line, and SIGTERM, SIGINT or SIGHUP end every process of it.
    """
    import uuid

    from hvdp import supervise

    args = parse_run_args(argv)
    command, env = build_command(args, os.environ, os.cpu_count() or 1, horovodrun_path())
    if args.elastic and not args.dry_run:
        found = check_discovery_script(args.discovery_script or "")
        slots = sum(count for _, count in found)
        if args.min_np is not None and slots < args.min_np:
            print(f"hvdp run: the discovery script lists {slots} slot(s) now, fewer than --min-np "
                  f"{args.min_np}; the job waits for more (up to --elastic-timeout {args.elastic_timeout} s).",
                  file=sys.stderr, flush=True)
        elif len(found) < 2 and not args.network_interfaces:
            print(f"hvdp run: the discovery script lists {len(found)} host(s) now; Horovod's elastic driver "
                  f"waits for 2 to find their common network interfaces (up to --elastic-timeout "
                  f"{args.elastic_timeout} s) unless --network-interface NIC is given (e.g. lo when every host "
                  f"is this machine).", file=sys.stderr, flush=True)
    if args.dry_run:
        for key, value in sorted(env.items()):
            print(f"{key}={value}")
        print(" ".join(command))
        return 0
    job_id = uuid.uuid4().hex
    job = supervise.Job(command=command, env=supervise.job_env(env, job_id), mpi=args.controller == "mpi")
    hosts, _ = (None, "") if args.elastic else resolve_hosts(args, os.environ)
    remote = sorted({name for name, _ in hosts or []} - supervise.local_addresses())
    if remote:
        job.remote = supervise.RemoteStop(remote, job_id, args.ssh_port, args.ssh_identity_file)
    reader = None
    if args.elastic:
        script = args.discovery_script or ""

        def list_hosts() -> str:
            return supervise.hosts_line(check_discovery_script(script, timeout_s=10))

        job.elastic = supervise.ElasticReporter(args.min_np or 1, supervise.JobWatcher(), list_hosts,
                                                say=lambda text: print(text, file=sys.stderr, flush=True))
        read_fd, job.events_fd = os.pipe()
        # Horovod's own driver, reporting what it decides (hvdp/elastic_driver.py).
        job.command = [sys.executable, "-m", "hvdp.elastic_driver", "--events-fd", str(job.events_fd),
                       *command[1:]]
        import threading

        reader = threading.Thread(target=job.elastic.read, args=(os.fdopen(read_fd, "r"),), daemon=True)
        reader.start()
    returncode, watcher = supervise.supervise(job)
    if reader is not None:
        reader.join(timeout=2)
    if returncode != 0 and not job.received:
        final = job.elastic.final_line() if job.elastic is not None else None
        print(final or watcher.summary(returncode), file=sys.stderr, flush=True)
    return returncode

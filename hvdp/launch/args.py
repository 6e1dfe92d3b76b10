"""``hvdp run``'s command line: :class:`RunArgs` and :func:`parse_run_args`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from hvdp import _framework
from hvdp.errors import FrameworkError, LaunchError
from hvdp.launch.hosts import parse_hosts

#: What ``--output`` accepts (:mod:`hvdp.launch.relay`).
OUTPUT_MODES = ("all", "rank0", "prefixed")

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
  --output all|rank0|prefixed
                        all (default): rank 0's output as it writes it (a progress bar redraws in
                        place), the other ranks' lines prefixed [N] when they print; rank0: rank 0
                        only; prefixed: every rank's lines prefixed [N]
  --log-dir DIR         keep every rank's complete output in DIR/rankN.log (horovodrun's own in
                        DIR/launcher.log)
  --startup-logs        show the frameworks' start-up log lines (TensorFlow, absl, oneDNN), hidden
                        from the terminal by default
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
    output: str = "all"
    log_dir: Optional[str] = None
    startup_logs: bool = False

#: A network interface name (Linux allows at most 15 characters).
_NIC = re.compile(r"^[\w.:@-]{1,15}$")


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
    output = "all"
    log_dir: Optional[str] = None
    startup_logs = False
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
        elif flag == "--output":
            output = take()
            if output not in OUTPUT_MODES:
                raise LaunchError(f"hvdp run: --output {output!r}: expected one of {', '.join(OUTPUT_MODES)} "
                                  f"(all: rank 0 as it writes, the others' lines prefixed [N]).")
        elif flag == "--log-dir":
            log_dir = take()
        elif token == "--startup-logs":
            startup_logs = True
            i += 1
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
                   discovery_script=discovery_script, output=output, log_dir=log_dir,
                   startup_logs=startup_logs,
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


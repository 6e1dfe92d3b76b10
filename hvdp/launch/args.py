"""``hvdp run``'s command line: :class:`RunArgs` and :func:`parse_run_args`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from hvdp import _runtime
from hvdp.errors import FrameworkError, LaunchError
from hvdp.launch.hosts import parse_hosts

#: What ``--output`` accepts (:mod:`hvdp.launch.relay`).
OUTPUT_MODES = ("all", "rank0", "prefixed")

DESCRIPTION = "Runs COMMAND (a .py file is run with this Python) on N processes through horovodrun."

EPILOG = """When a rank dies or stalls, every other rank is stopped and hvdp run exits non-zero
with a line naming the first failure (a rank's exception: its traceback, printed once).
SIGTERM, SIGINT (Ctrl-C) or SIGHUP to hvdp run end every process of the job (SIGKILL
after 5 s) and hvdp run exits 128 + the signal.

Defaults hvdp sets when you have not: OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS and
TF_NUM_INTEROP_THREADS so that local processes share the cores instead of
oversubscribing them (in a Slurm allocation: SLURM_CPUS_PER_TASK threads); for local
jobs, HOROVOD_CYCLE_TIME=5, MALLOC_MMAP_THRESHOLD_=134217728,
MALLOC_TRIM_THRESHOLD_=268435456, THP_MEM_ALLOC_ENABLE=1 and, under --mpi,
OMPI_MCA_mpi_yield_when_idle=1 (measured by hvdp bench; see hvdp/launch/defaults.py).
Any other option before COMMAND is passed to horovodrun (see horovodrun --help)."""


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


def run_parser() -> argparse.ArgumentParser:
    """The parser of ``hvdp run``'s own options: its groups are ``hvdp run --help``.

    Values stay text here; :func:`parse_run_args` checks them with messages that name the fix.
    """
    parser = argparse.ArgumentParser(
        prog="hvdp run", usage="hvdp run [options] [horovodrun options] COMMAND ...", description=DESCRIPTION,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.error = _error  # type: ignore[method-assign,assignment]
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the program and its arguments (a .py file runs with this Python)")
    procs = parser.add_argument_group("processes and hosts")
    procs.add_argument("-np", "--num-proc", "-n", dest="num_proc", metavar="N",
                       help="number of processes (default with hosts: their slots; in a Slurm allocation: "
                            "all its tasks)")
    procs.add_argument("-H", "--hosts", metavar="HOSTS",
                       help="e.g. host1:2,host2:2 (default: localhost:N, or the Slurm allocation's nodes)")
    procs.add_argument("--hostfile", "-hostfile", metavar="FILE",
                       help="one 'host slots=N' (or 'host:N', or 'host' for 1 slot) per line; # comments")
    procs.add_argument("-p", "--ssh-port", metavar="PORT", help="ssh port of every host (default: ssh's own, 22)")
    procs.add_argument("-i", "--ssh-identity-file", metavar="KEY", help="private key ssh uses to reach the hosts")
    procs.add_argument("--network-interface", "--network-interfaces", dest="nics", action="append", default=[],
                       metavar="NIC", help="the interface ranks talk over, e.g. eth0 (repeat, or a,b, for several; "
                                           "default: horovodrun finds the interfaces common to all hosts)")
    framework = parser.add_argument_group("framework and controller")
    framework.add_argument("--framework", metavar="NAME",
                           help="torch or tensorflow: hvdp.init() in every process uses it, and Keras 3 models run "
                                "on the same backend (KERAS_BACKEND)")
    framework.add_argument("--gloo", dest="controllers", action="append_const", const="gloo", default=[],
                           help="the Gloo controller (the default: the faster one on CPU here)")
    framework.add_argument("--mpi", dest="controllers", action="append_const", const="mpi",
                           help="the MPI controller (mpirun)")
    output = parser.add_argument_group("output")
    output.add_argument("--output", default="all", metavar="|".join(OUTPUT_MODES),
                        help="all (default): rank 0's output as it writes it (a progress bar redraws in place), "
                             "the other ranks' lines prefixed [N] when they print; rank0: rank 0 only; "
                             "prefixed: every rank's lines prefixed [N]")
    output.add_argument("--log-dir", metavar="DIR",
                        help="keep every rank's complete output in DIR/rankN.log (horovodrun's own in "
                             "DIR/launcher.log)")
    output.add_argument("--startup-logs", action="store_true",
                        help="show the frameworks' start-up log lines (TensorFlow, absl, oneDNN), hidden from "
                             "the terminal by default")
    watch = parser.add_argument_group("stalls and profiling")
    watch.add_argument("--stall-timeout", metavar="S",
                       help=f"end the job when a rank has not joined a collective for S seconds (default "
                            f"{DEFAULT_STALL_TIMEOUT}; Horovod's stall inspector names the missing ranks and "
                            f"tensors; 0 turns it off)")
    watch.add_argument("--profile", metavar="DIR", help="record hvdp.profiler steps of every rank in DIR "
                                                        "(then: hvdp report DIR)")
    watch.add_argument("--timeline", metavar="FILE", help="write Horovod's timeline of the run to FILE "
                                                          "(chrome://tracing format)")
    elastic = parser.add_argument_group("elastic training (hvdp.elastic)")
    elastic.add_argument("--elastic", action="store_true",
                         help="workers may fail, leave and join while the job runs; needs Gloo (not --mpi) and "
                              "a discovery script")
    elastic.add_argument("--host-discovery-script", dest="discovery_script", metavar="FILE",
                         help="an executable that prints the hosts available now, one 'HOST:SLOTS' (or 'HOST', "
                              "1 slot unless --slots-per-host) per line; run every second")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", metavar="N",
                         help="train while at least N processes are up (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", metavar="M",
                         help="never start more than M processes (default: as many as there are slots; -np, "
                              "default --min-np, is the number to start with)")
    elastic.add_argument("--elastic-timeout", metavar="S",
                         help=f"end an elastic job that has waited S seconds for --min-np processes (default "
                              f"{DEFAULT_ELASTIC_TIMEOUT}; meanwhile hvdp run says what it waits for)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and the environment hvdp sets, run nothing")
    return parser


def _error(message: str) -> None:
    raise LaunchError(f"hvdp run: {message}. See hvdp run --help.")


def split_args(argv: List[str], own: Dict[str, int],
               arity: Optional[Dict[str, int]] = None) -> Tuple[List[str], List[str], List[str]]:
    """``hvdp run``'s arguments as (hvdp's own options, horovodrun's options, the command).

    The command starts at the first word that is not an option (or after ``--``); each
    option takes as many values as its parser says (``own`` for hvdp's, horovodrun's own
    parser for the rest, read only when such an option appears).

    Example:
        >>> split_args(["-np", "2", "--verbose", "t.py", "-x"], {"-np": 1}, {"--verbose": 0})
        (['-np', '2'], ['--verbose'], ['t.py', '-x'])
    """
    mine: List[str] = []
    passthrough: List[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, equals, _ = token.partition("=")
        if token == "--":
            return mine, passthrough, argv[i + 1:]
        if not token.startswith("-"):
            break
        if flag in own:
            count = 0 if equals else own[flag]
            values = argv[i + 1:i + 1 + count]
            if len(values) < count or any(value.startswith("-") for value in values):
                raise LaunchError(f"hvdp run: {flag} needs a value. See hvdp run --help.")
            mine += argv[i:i + 1 + count]
        else:
            table = horovodrun_arity() if arity is None else arity
            if flag not in table:
                raise LaunchError(f"hvdp run: unknown option {flag!r}: not an hvdp run option nor a "
                                  f"horovodrun option. See hvdp run --help and horovodrun --help.")
            count = 0 if equals else table[flag]
            passthrough += argv[i:i + 1 + count]
        i += 1 + count
    return mine, passthrough, argv[i:]


def _count(flag: str, raw: Optional[str], least: int, what: str) -> Optional[int]:
    """A whole number option, or LaunchError naming the value and an example."""
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < least:
        raise LaunchError(f"hvdp run: {flag} {raw!r} is not {what}, e.g. {flag} {max(least, 2)}.")
    return int(raw)


def parse_run_args(argv: List[str], arity: Optional[Dict[str, int]] = None) -> RunArgs:
    """Parse ``hvdp run`` arguments (everything after ``run``).

    Example:
        >>> parse_run_args(["-np", "2", "--framework", "torch", "train.py"], arity={}).framework
        'torch'
    """
    parser = run_parser()
    own = {option: 0 if action.nargs == 0 else 1 for action in parser._actions for option in action.option_strings}
    mine, passthrough, command = split_args(argv, own, arity)
    ns = parser.parse_args(mine)
    num_proc: Optional[int] = None
    if ns.num_proc is not None:
        try:
            num_proc = int(ns.num_proc)
        except ValueError:
            raise LaunchError(f"hvdp run: -np {ns.num_proc!r} is not a number; give the process count, "
                              f"e.g. -np 2.") from None
    ssh_port: Optional[int] = None
    if ns.ssh_port is not None:
        if not ns.ssh_port.isdigit() or not 1 <= int(ns.ssh_port) <= 65535:
            raise LaunchError(f"hvdp run: --ssh-port {ns.ssh_port!r} is not a port number (1-65535); "
                              f"e.g. --ssh-port 2222.")
        ssh_port = int(ns.ssh_port)
    nics: List[str] = []
    for raw in ns.nics:
        for nic in raw.split(","):
            if not _NIC.match(nic.strip()):
                raise LaunchError(f"hvdp run: --network-interface {raw!r}: {nic.strip()!r} is not a network "
                                  f"interface name; e.g. --network-interface eth0 (ip -br link lists them).")
            if nic.strip() not in nics:
                nics.append(nic.strip())
    if len(set(ns.controllers)) > 1:
        raise LaunchError("hvdp run: --gloo and --mpi both given; choose one controller.")
    controller = ns.controllers[0] if ns.controllers else None
    if ns.output not in OUTPUT_MODES:
        raise LaunchError(f"hvdp run: --output {ns.output!r}: expected one of {', '.join(OUTPUT_MODES)} "
                          f"(all: rank 0 as it writes, the others' lines prefixed [N]).")
    stall_timeout = DEFAULT_STALL_TIMEOUT
    if ns.stall_timeout is not None:
        if not ns.stall_timeout.isdigit():
            raise LaunchError(f"hvdp run: --stall-timeout {ns.stall_timeout!r} is not a whole number of seconds; "
                              f"e.g. --stall-timeout 120 (0 turns the check off).")
        stall_timeout = int(ns.stall_timeout)
    min_np = _count("--min-np", ns.min_np, 1, "a process count; give a whole number of at least 1")
    max_np = _count("--max-np", ns.max_np, 1, "a process count; give a whole number of at least 1")
    elastic_timeout: Optional[int] = None
    if ns.elastic_timeout is not None:
        if not ns.elastic_timeout.isdigit() or int(ns.elastic_timeout) < 1:
            raise LaunchError(f"hvdp run: --elastic-timeout {ns.elastic_timeout!r} is not a whole number of "
                              f"seconds (at least 1); e.g. --elastic-timeout {DEFAULT_ELASTIC_TIMEOUT}.")
        elastic_timeout = int(ns.elastic_timeout)
    if num_proc is not None and num_proc < 1:
        raise LaunchError(f"hvdp run: -np {num_proc} must be at least 1.")
    if not command:
        raise LaunchError("hvdp run: no command given; e.g. hvdp run -np 2 examples/train_digits.py.")
    if ns.framework is not None:
        try:
            _runtime.check_name(ns.framework, "hvdp run --framework")
        except FrameworkError as exc:
            raise LaunchError(str(exc)) from None
    if ns.hosts and ns.hostfile:
        raise LaunchError("hvdp run: give -H/--hosts or --hostfile, not both.")
    if ns.hosts:
        parse_hosts(ns.hosts)
    if elastic_timeout is not None and not ns.elastic:
        raise LaunchError("hvdp run: --elastic-timeout only applies to elastic jobs; add --elastic "
                          "(hvdp run --elastic --host-discovery-script FILE ...).")
    if ns.elastic or min_np is not None or max_np is not None or ns.discovery_script is not None:
        min_np, max_np = check_elastic_args(ns.elastic, num_proc, min_np, max_np, ns.discovery_script,
                                            controller, ns.hosts or ns.hostfile)
    return RunArgs(num_proc=num_proc, command=command, framework=ns.framework,
                   controller=controller or "gloo", hosts=ns.hosts, hostfile=ns.hostfile,
                   ssh_port=ssh_port, ssh_identity_file=ns.ssh_identity_file, network_interfaces=nics,
                   dry_run=ns.dry_run, passthrough=passthrough, profile=ns.profile, timeline=ns.timeline,
                   stall_timeout=stall_timeout, elastic=ns.elastic, min_np=min_np, max_np=max_np,
                   discovery_script=ns.discovery_script, output=ns.output, log_dir=ns.log_dir,
                   startup_logs=ns.startup_logs,
                   elastic_timeout=(elastic_timeout or DEFAULT_ELASTIC_TIMEOUT) if ns.elastic else None)


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


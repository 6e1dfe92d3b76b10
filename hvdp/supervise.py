"""Supervising a running job: relay its output, read its failures, and end all of it on a signal.

:func:`supervise` starts the command :func:`hvdp.launch.build_command` built and stays
with it until it ends:

- its output reaches the terminal line by line, and :class:`JobWatcher` reads which ranks
  failed and why; under ``--mpi``, :class:`TagJoiner` puts back together the lines Open MPI
  cut into one tagged piece per write;
- SIGTERM, SIGINT and SIGHUP end every process of the job: ``hvdp run`` is the child
  subreaper of the job (so ranks whose parents died stay in its tree), sends SIGTERM to the
  whole tree, SIGKILL to what is left after :data:`GRACE_S`, ends remote ranks over ssh, and
  exits with 128 + the signal number after one line saying what it stopped;
- an elastic job runs Horovod's own driver in :mod:`hvdp.elastic_driver`, which reports
  what the driver decides (a worker exited, hosts blacklisted, too few slots, a timeout) as
  records; :class:`ElasticReporter` turns them into messages on the launcher's terminal.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import psutil  # type: ignore[import-untyped]

#: Seconds the job's processes get to end after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Signals that end the job (what timeout, systemd, Kubernetes, Docker and a terminal send).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds between reminders while an elastic job waits for workers.
WAIT_REMINDER_S = 10.0
#: Seconds an elastic job may wait for its first workers before hvdp run says what it waits for.
START_GRACE_S = 5.0
#: The environment variable that marks every process of one job (remote ranks included).
JOB_ID_VAR = "HVDP_JOB_ID"

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so none leaves its tree."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------- the job's output


_GLOO_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_MPI_STATUS = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
_MPI_CODE = re.compile(r"Exit code:\s+(\d+)")
_RAISED = re.compile(r"^\[(?:\d+,)?(\d+)\]<stderr>:([\w.]*(?:Error|Exception|Interrupt)): (.*)$")
_STALLED = re.compile(r"(?:<stderr>:)?(\d+)!: \[(.*?)\]")


def describe_exit(code: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL`` for a process exit code.

    Example:
        >>> describe_exit(-9)
        'was killed by SIGKILL'
    """
    if code < 0 or 128 < code <= 128 + 64:  # -N from Python, 128+N from a shell; 255 is ssh's own failure
        number = -code if code < 0 else code - 128
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {code}"


class JobWatcher:
    """Reads the job's output as it passes through and remembers which ranks failed and why."""

    def __init__(self) -> None:
        self.failed: Dict[int, str] = {}
        self.stalled: Dict[int, str] = {}
        self.raised: Dict[int, str] = {}
        self._mpi_rank: Optional[int] = None

    def feed(self, line: str) -> None:
        """Look at one line of the job's output."""
        found = _GLOO_EXIT.search(line)
        if found and found.group(2) not in ("0", "143", "-15"):  # SIGTERM: stopped by the launcher
            self.failed.setdefault(int(found.group(1)), describe_exit(int(found.group(2))))
        found = _MPI_SIGNAL.search(line)
        if found:
            self.failed.setdefault(int(found.group(1)), describe_exit(-int(found.group(2))))
        found = _MPI_STATUS.search(line)
        if found:
            self._mpi_rank = int(found.group(1))
        found = _MPI_CODE.search(line)
        if found and self._mpi_rank is not None:
            self.failed.setdefault(self._mpi_rank, describe_exit(int(found.group(1))))
            self._mpi_rank = None
        for rank, tensors in _STALLED.findall(line):
            self.stalled[int(rank)] = tensors
        found = _RAISED.search(line.rstrip("\n"))
        if found and "Horovod has been shut down" not in found.group(3):  # a consequence, not a cause
            self.raised[int(found.group(1))] = f"{found.group(2).rsplit('.', 1)[-1]}: {found.group(3)}"

    def summary(self, returncode: int) -> str:
        """One line for the user: which ranks failed or stalled, and that the job was ended."""
        if self.stalled:
            ranks = "; ".join(f"rank {r} never submitted {t}" for r, t in sorted(self.stalled.items()))
            return (f"hvdp: the job was ended: {ranks} (stalled longer than --stall-timeout). "
                    "Every rank must make the same collective calls in the same order.")
        causes = {r: f"raised {why}" for r, why in self.raised.items()}
        for r, why in self.failed.items():
            causes.setdefault(r, why)
        if self.raised:  # ranks that exited only because another one failed are not causes
            causes = {r: why for r, why in causes.items() if r in self.raised or "killed" in why}
        if causes:
            ranks = "; ".join(f"rank {r} {why}" for r, why in sorted(causes.items()))
            return f"hvdp: the job failed: {ranks}. The other ranks were stopped (exit code {returncode})."
        return f"hvdp: the job failed with exit code {returncode}; see the output above."


_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


class TagJoiner:
    """Puts back together the lines of ranks under Open MPI's ``--tag-output``.

    Open MPI tags every piece a rank writes, not every line: a rank writing unbuffered
    (``PYTHONUNBUFFERED=1``) prints a traceback's ``~~~^^^`` markers one write at a time,
    which reaches the terminal as ``[1,1]<stderr>:~[1,1]<stderr>:^...``, and pieces of
    several ranks can share one line. The joiner keeps each rank's pieces until that
    rank's newline and gives back whole lines, each with its tag once.

    Example:
        >>> TagJoiner().feed("[1,1]<stderr>: [1,1]<stderr>:~[1,0]<stdout>:ok\\n")
        ['[1,0]<stdout>:ok\\n']
    """

    def __init__(self) -> None:
        self._pending: Dict[str, str] = {}

    def feed(self, line: str) -> List[str]:
        """One line of mpirun's output; the whole lines it completes, in order."""
        tags = list(_TAG.finditer(line))
        if not tags:
            return [line]
        out: List[str] = []
        if tags[0].start() > 0:  # mpirun's own text before the first tag
            out.append(line[:tags[0].start()] + "\n")
        for index, tag in enumerate(tags):
            end = tags[index + 1].start() if index + 1 < len(tags) else len(line)
            piece = line[tag.end():end]
            if piece.endswith("\n"):
                out.append(tag.group(0) + self._pending.pop(tag.group(0), "") + piece)
            else:
                self._pending[tag.group(0)] = self._pending.get(tag.group(0), "") + piece
        return out

    def flush(self) -> List[str]:
        """What is left when the output ends: each rank's unfinished line."""
        left = [tag + text + "\n" for tag, text in self._pending.items()]
        self._pending.clear()
        return left


# ---------------------------------------------------------------- ending the job


def _ranks_of(process: Any) -> Optional[str]:
    """The rank a process of the job is, from its environment; None for launchers and shells."""

    try:
        environ = process.environ()
    except (psutil.Error, OSError):
        return None
    return environ.get("HOROVOD_RANK") or environ.get("OMPI_COMM_WORLD_RANK")


@dataclass
class Stopped:
    """What :func:`stop_tree` ended."""

    ranks: List[str] = field(default_factory=list)
    launchers: List[str] = field(default_factory=list)
    others: int = 0
    killed: List[str] = field(default_factory=list)
    seconds: float = 0.0
    left: List[int] = field(default_factory=list)
    remote: List[str] = field(default_factory=list)

    def describe(self) -> str:
        """``horovodrun, ranks 0 and 1 and 4 helper processes``."""
        parts = [name if self.launchers.count(name) == 1 else
                 f"{self.launchers.count(name)} {name}{' clients' if name == 'ssh' else 's'}"
                 for name in dict.fromkeys(self.launchers)]
        if self.ranks:
            ranks = sorted(set(self.ranks), key=lambda r: int(r) if r.isdigit() else 0)
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {_and(ranks)}")
        if self.others:
            parts.append(f"{self.others} helper process{'es' if self.others > 1 else ''}")
        for host in self.remote:
            parts.append(f"the ranks on {host}")
        return _and(parts) if parts else "nothing (the job had already ended)"


def _and(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _counted(labels: Sequence[str]) -> List[str]:
    """``["rank 1", "2 helper processes"]`` for a list of process labels."""
    counts = {label: labels.count(label) for label in labels}
    return [label if count == 1 else f"{count} {label.replace('a helper process', 'helper processes')}"
            for label, count in counts.items()]


def _launcher_name(process: Any) -> Optional[str]:

    try:
        words = [os.path.basename(word) for word in process.cmdline()[:3]]
    except (psutil.Error, OSError):
        return None
    for name in ("horovodrun", "mpirun", "orterun", "ssh"):
        if name in words:
            return name
    if "hvdp.elastic_driver" in " ".join(words):
        return "horovodrun"
    return None


def descendants() -> List[Any]:
    """Every live process below this one (with the subreaper set, orphans of the job included)."""
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def reap_orphans(keep: Iterable[int] = ()) -> None:
    """Collect the exit status of adopted processes that ended (not the ones in ``keep``)."""

    kept = set(keep)
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        if child.pid in kept:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            pass


def stop_tree(grace_s: float = GRACE_S, keep: Iterable[int] = (), urgent: Optional[threading.Event] = None,
              remote: Optional["RemoteStop"] = None) -> Stopped:
    """End every descendant of this process: SIGTERM, then SIGKILL to what is left after ``grace_s``.

    New descendants (a launcher starting a worker meanwhile) get the same. ``urgent`` set
    (a second Ctrl-C) skips the rest of the grace period; ``remote`` ends the remote ranks.
    """

    start = time.monotonic()
    stopped = Stopped()
    seen: Dict[int, psutil.Process] = {}
    labels: Dict[int, str] = {}
    kept: Set[int] = set()

    def job() -> List[Any]:
        return [p for p in descendants() if p.pid not in kept]

    def signal_all(sig: int) -> None:
        alive = job()
        for process in alive:  # what each process is, before any of them ends
            if process.pid not in seen:
                seen[process.pid] = process
                rank, launcher = _ranks_of(process), _launcher_name(process)
                if rank is not None:
                    stopped.ranks.append(rank)
                    labels[process.pid] = f"rank {rank}"
                elif launcher is not None:
                    stopped.launchers.append(launcher)
                    labels[process.pid] = launcher
                else:
                    stopped.others += 1
        for process in alive:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass

    if remote is not None:  # at the same time as the local processes, and not ended with them
        kept.update(remote.start())
    signal_all(signal.SIGTERM)
    deadline = start + grace_s
    while time.monotonic() < deadline and not (urgent is not None and urgent.is_set()):
        reap_orphans(keep)
        alive = job()
        if not alive:
            break
        if any(p.pid not in seen for p in alive):
            signal_all(signal.SIGTERM)
        time.sleep(0.05)
    for _ in range(20):
        alive = job()
        if not alive:
            break
        for process in alive:
            stopped.killed.append(labels.get(process.pid) or "a helper process")
        signal_all(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=1)
        reap_orphans(keep)
    if remote is not None:
        stopped.remote = remote.wait()
    reap_orphans(keep)
    stopped.left = [p.pid for p in job()]
    stopped.seconds = time.monotonic() - start
    return stopped


def stop_script(job_id: str) -> str:
    """A shell command that ends, on the host it runs on, every process whose environment has the job's id.

    One grep over every process's environment finds them (GNU grep: ``-z`` reads
    NUL-separated entries); SIGTERM, up to 3 s to end, then SIGKILL.
    """
    marker = shlex.quote(f"{JOB_ID_VAR}={job_id}")
    find = (f"grep -lzx {marker} /proc/[0-9]*/environ 2>/dev/null | "
            "sed -n 's#^/proc/\\([0-9]*\\)/environ$#\\1#p'")
    script = (f"p=$({find}); [ -z \"$p\" ] && exit 0; kill -TERM $p 2>/dev/null; "
              f"for i in 1 2 3 4 5 6; do sleep 0.5; p=$({find}); [ -z \"$p\" ] && exit 0; done; "
              f"kill -KILL $p 2>/dev/null; exit 0")
    return script


class RemoteStop:
    """Ends, on every remote host, the processes carrying this job's id.

    horovodrun starts remote ranks with ssh and no terminal, so ending the local ssh
    client does not end them; every process of the job has ``HVDP_JOB_ID`` in its
    environment, so one ssh command per host finds and ends exactly those.
    """

    def __init__(self, hosts: Sequence[str], job_id: str, ssh_port: Optional[int], identity: Optional[str]) -> None:
        self.hosts = list(hosts)
        self.script = stop_script(job_id)
        self.ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "ConnectTimeout=3"]
        if ssh_port is not None:
            self.ssh += ["-p", str(ssh_port)]
        if identity:
            self.ssh += ["-i", identity]
        self._calls: List[subprocess.Popen] = []

    def start(self) -> List[int]:
        """Start one ssh per host; their pids (not to be ended with the job)."""
        self._calls = [subprocess.Popen([*self.ssh, host, self.script], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for host in self.hosts]
        return [call.pid for call in self._calls]

    def wait(self, timeout_s: float = 8.0) -> List[str]:
        """The hosts where the job's processes were ended."""
        reached = []
        for host, call in zip(self.hosts, self._calls):
            try:
                if call.wait(timeout=timeout_s) == 0:
                    reached.append(host)
            except subprocess.TimeoutExpired:
                call.kill()
                call.wait()
        return reached


# ---------------------------------------------------------------- elastic jobs


@dataclass
class Removal:
    """A host the elastic driver blacklisted, and why."""

    host: str
    ranks: List[int]
    codes: List[int]
    until: Optional[float]


class ElasticReporter:
    """Turns the elastic driver's records into messages while the job has too few workers.

    Records (one JSON object per line, from :mod:`hvdp.elastic_driver`): ``exit`` (a
    worker process ended: host, slot, rank, code), ``recorded`` (every worker reported
    after a failure: which failed, which are ready), ``blacklisted`` (a host removed, its
    failed ranks, the end of its cooldown), ``waiting`` (too few slots: the driver waits up
    to ``timeout`` seconds), ``resumed``, ``timeout``.
    """

    def __init__(self, min_np: int, watcher: JobWatcher, list_hosts: Callable[[], str],
                 say: Callable[[str], None], reminder_s: float = WAIT_REMINDER_S) -> None:
        self.min_np = min_np
        self.watcher = watcher
        self.list_hosts = list_hosts
        self.say = say
        self.reminder_s = reminder_s
        self.removed: List[Removal] = []
        self.exits: Dict[Tuple[str, int], Tuple[int, int]] = {}
        self.workers_left: Optional[int] = None
        self._ready: List[str] = []
        self._said = False
        self.waiting_since: Optional[float] = None
        self.waiting: Dict[str, object] = {}
        self.timed_out: Optional[str] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def handle(self, record: Dict[str, object]) -> None:
        """Take one record from the driver."""
        kind = record.get("event")
        with self._lock:
            if kind == "exit":
                key = (str(record["host"]), int(record["slot"]))  # type: ignore[call-overload]
                self.exits[key] = (int(record["rank"]), int(record["code"]))  # type: ignore[call-overload]
            elif kind == "recorded":
                self._ready = [str(host) for host, _ in record.get("ready", [])]  # type: ignore[attr-defined]
                self.workers_left = len(self._ready)
            elif kind == "blacklisted":
                host = str(record["host"])
                ranks = [int(r) for r in record.get("ranks", [])]  # type: ignore[attr-defined]
                codes = [code for (h, _), (_, code) in self.exits.items() if h == host]
                until = record.get("until")
                self.removed.append(Removal(host, ranks, codes, float(until) if until else None))  # type: ignore[arg-type]
                # Horovod removes whole hosts: the healthy workers of a removed host go with it.
                self.workers_left = len([h for h in self._ready if h not in {r.host for r in self.removed}])
            elif kind == "waiting":
                self.waiting_since = time.time()
                self.waiting = record
            elif kind == "resumed":
                self.waiting_since = None
            elif kind == "timeout":
                self.timed_out = str(record.get("message", ""))
        if kind == "waiting" and record.get("phase") != "start":  # at the start: only if it lasts
            self._said = True
            self.say(self.wait_message())
        elif kind == "resumed" and record.get("after_wait") and self._said:
            self._said = False
            self.say(f"hvdp run: enough slots again ({record.get('slots')} for --min-np {self.min_np}); "
                     f"the job goes on.")
        self._wake.set()

    def _why(self, removal: Removal) -> str:
        reasons = []
        for rank in removal.ranks:
            raised = self.watcher.raised.get(rank)
            code = next((c for (h, _), (r, c) in self.exits.items() if h == removal.host and r == rank), None)
            if raised:
                reasons.append(f"rank {rank} raised {raised}")
            elif code is not None and code != 0:
                reasons.append(f"rank {rank} {describe_exit(code)}")
            else:
                reasons.append(f"rank {rank} failed")
        healthy = sum(1 for host in self._ready if host == removal.host)
        if healthy:
            reasons.append(f"{healthy} healthy worker{'s' if healthy > 1 else ''} on it stopped too: "
                           f"Horovod removes whole hosts")
        when = ("for good (no --blacklist-cooldown-range)" if removal.until is None else
                f"until {time.strftime('%H:%M:%S', time.localtime(removal.until))}")
        return f"{removal.host} ({'; '.join(reasons) or 'a worker failed'}), blacklisted {when}"

    def wait_message(self) -> str:
        """What the job is waiting for, and for how long: several lines, each starting ``hvdp run:``."""
        with self._lock:
            record = dict(self.waiting)
            since = self.waiting_since or time.time()
            removed = [r for r in self.removed if r.until is None or r.until > time.time()]
            left = self.workers_left
        timeout = float(record.get("timeout", 0))  # type: ignore[arg-type]
        remaining = max(0, int(since + timeout - time.time() + 0.5))
        needed = int(record.get("min_np", self.min_np))  # type: ignore[call-overload]
        available = record.get("slots", "?")
        lines = []
        if self._hosts_short(record):
            lines.append(f"hvdp run: waiting for a second host to start the job: Horovod's elastic driver needs "
                         f"{record.get('min_hosts')} hosts listed to find their common network interfaces, "
                         f"unless --network-interface is given.")
        elif record.get("phase") == "start":
            lines.append(f"hvdp run: waiting for {needed} slots to start the job; the hosts offer {available}.")
        else:
            who = f"{left} worker{'s' if left != 1 else ''} left" if left is not None else "too few workers"
            lines.append(f"hvdp run: the job is below --min-np {self.min_np}: {who}, "
                         f"{available} usable slot(s) now.")
        for removal in removed:
            lines.append(f"hvdp run:   removed {self._why(removal)}")
        try:
            listed = self.list_hosts()
        except Exception as exc:  # the message must go out whatever the script does
            listed = f"(the script failed: {exc})"
        lines.append(f"hvdp run:   the discovery script lists now: {listed or '(no hosts)'}")
        wanted = (f"{record.get('min_hosts')} hosts (or restart with --network-interface NIC, e.g. lo when "
                  f"every host is this machine)") if self._hosts_short(record) else f"{needed} usable slots"
        lines.append(f"hvdp run:   waiting up to {remaining} s more (--elastic-timeout {int(timeout)}) for "
                     f"{wanted}; Ctrl-C ends the job.")
        return "\n".join(lines)

    @staticmethod
    def _hosts_short(record: Dict[str, object]) -> bool:
        """Whether the driver waits for hosts (to find network interfaces), not for slots."""
        hosts, min_hosts = record.get("hosts"), record.get("min_hosts", 1)
        slots, needed = record.get("slots"), record.get("min_np", 0)
        return (isinstance(hosts, int) and isinstance(min_hosts, int) and hosts < min_hosts and
                isinstance(slots, int) and isinstance(needed, int) and slots >= needed)

    def remind(self, stop: threading.Event) -> None:
        """Repeat the wait message every ``reminder_s`` seconds while the job waits (a thread)."""
        last = time.monotonic()
        while not stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                waiting = self.waiting_since is not None and self.timed_out is None
                starting = self.waiting.get("phase") == "start" and not self._said
            if not waiting:
                last = time.monotonic()
            elif starting and time.monotonic() - last >= START_GRACE_S:
                # Horovod's first discovery takes a moment: say so only when the wait is real.
                last = time.monotonic()
                self._said = True
                self.say(self.wait_message())
            elif time.monotonic() - last >= self.reminder_s:
                last = time.monotonic()
                self.say(self.wait_message())

    def read(self, stream: IO[str]) -> None:
        """Handle every record of ``stream`` until it ends (a thread)."""
        for line in stream:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.handle(record)

    def final_line(self) -> Optional[str]:
        """The line that names why an elastic job ended, when the wait for workers ended it."""
        if self.timed_out is None:
            return None
        with self._lock:
            record = dict(self.waiting)
            left = self.workers_left
        who = f" with {left} worker{'s' if left != 1 else ''}" if left is not None else ""
        if self._hosts_short(record):
            return (f"hvdp: the elastic job was ended: it waited {record.get('timeout')} s (--elastic-timeout) for "
                    f"a second host: Horovod's elastic driver needs {record.get('min_hosts')} hosts listed to find "
                    f"their common network interfaces, and the discovery script listed {record.get('hosts')}. List "
                    f"another host, or give --network-interface NIC (e.g. lo when every host is this machine).")
        return (f"hvdp: the elastic job was ended: it waited {record.get('timeout')} s (--elastic-timeout){who} "
                f"for {record.get('min_np', self.min_np)} usable slots (--min-np) and the hosts offered "
                f"{record.get('slots')}. List more hosts in the discovery script, lower --min-np, or raise "
                f"--elastic-timeout.")


# ---------------------------------------------------------------- the supervisor


@dataclass
class Job:
    """One job under supervision: what to run and how to watch it."""

    command: List[str]
    env: Dict[str, str]
    mpi: bool = False
    elastic: Optional[ElasticReporter] = None
    events_fd: Optional[int] = None
    remote: Optional[RemoteStop] = None
    grace_s: float = GRACE_S
    received: List[int] = field(default_factory=list)


def supervise(job: Job, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> Tuple[int, JobWatcher]:
    """Run ``job.command``, relay its output, and end all of it on SIGTERM, SIGINT or SIGHUP.

    Returns:
        The exit code (128 + the signal number when a signal ended the job) and the watcher.
    """
    become_subreaper()
    watcher = job.elastic.watcher if job.elastic is not None else JobWatcher()
    stop = threading.Event()
    urgent = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            urgent.set()  # a second signal: no more grace
        job.received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        # Its own session: a terminal's Ctrl-C reaches hvdp run alone, which ends the job in order.
        process = subprocess.Popen(job.command, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", bufsize=1, start_new_session=True,
                                   pass_fds=(job.events_fd,) if job.events_fd is not None else ())
        if job.events_fd is not None:
            os.close(job.events_fd)
        lock = threading.Lock()

        def write(text: str) -> None:
            with lock:
                out.write(text)
                out.flush()

        def relay() -> None:
            joiner = TagJoiner() if job.mpi else None
            for line in process.stdout if process.stdout is not None else ():
                for whole in joiner.feed(line) if joiner is not None else [line]:
                    write(whole)
                    watcher.feed(whole)
            for whole in joiner.flush() if joiner is not None else []:
                write(whole)
                watcher.feed(whole)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        if job.elastic is not None:
            elastic = job.elastic

            def say(text: str) -> None:
                with lock:
                    err.write(text + "\n")
                    err.flush()

            elastic.say = say
            threading.Thread(target=elastic.remind, args=(stop,), daemon=True).start()
        while process.poll() is None and not stop.wait(0.2):
            reap_orphans(keep=[process.pid])
        if stop.is_set():
            signum = job.received[0]
            name = signal.Signals(signum).name
            stopped = stop_tree(job.grace_s, keep=[process.pid], urgent=urgent, remote=job.remote)
            process.wait()
            reader.join(timeout=2)
            killed = f"; SIGKILL for {_and(_counted(stopped.killed))}" if stopped.killed else ""
            left = f"; still running: pids {stopped.left}" if stopped.left else ""
            err.write(f"hvdp run: stopped by {name}: ended {stopped.describe()} in {stopped.seconds:.1f} s"
                      f"{killed}{left}.\n")
            err.flush()
            return 128 + signum, watcher
        returncode = process.wait()
        reader.join(timeout=10)
        # Nothing of the job outlives it (e.g. workers an elastic driver left behind).
        if descendants():
            stop_tree(job.grace_s, keep=[process.pid])
        return returncode, watcher
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def hosts_line(found: Sequence[Tuple[str, int]]) -> str:
    """``localhost:1, 127.0.0.1:1`` for the hosts and slots of a discovery script."""
    return ", ".join(f"{host}:{slots}" for host, slots in found)


def job_env(env: Dict[str, str], job_id: str) -> Dict[str, str]:
    """The environment of a supervised job: the caller's, hvdp's additions, and the job's id."""
    return {**os.environ, **env, JOB_ID_VAR: job_id}


def local_addresses() -> Set[str]:
    """Names and addresses that mean this machine."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:

        for addresses in psutil.net_if_addrs().values():
            names.update(address.address for address in addresses)
    except Exception:  # best effort
        pass
    return names

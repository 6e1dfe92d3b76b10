"""Ending a job: every process of it, here and on its ssh hosts, on SIGTERM, SIGINT or SIGHUP.

``hvdp run`` is the child subreaper of the job (so ranks whose parents died stay in its
tree), sends SIGTERM to the whole tree, SIGKILL to what is left after :data:`GRACE_S`, and
ends remote ranks over ssh by the job id every process of the job carries.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import psutil  # type: ignore[import-untyped]

#: Seconds the job's processes get to end after SIGTERM before SIGKILL.
GRACE_S = 5.0
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
    if "hvdp.launch.elastic_driver" in words or "hvdp.launch.horovodrun" in words:
        return "horovodrun"
    return None


def descendants() -> List[Any]:
    """Every live process below this one (with the subreaper set, orphans of the job included).

    A process that ends while the tree is read is left out, and only it: while a job ends, its
    helpers vanish between the listing and the look at each (one error must not empty the list,
    or :func:`stop_tree` would take the tree for ended and skip the grace period).
    """
    try:
        listed = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    live = []
    for process in listed:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                live.append(process)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error:  # not ours to read (AccessDenied): still alive
            live.append(process)
    return live


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
            label = labels.get(process.pid) or "a helper process"
            if not (label.startswith("rank ") and label in stopped.killed):  # a rank and its bootstrap: once
                stopped.killed.append(label)
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

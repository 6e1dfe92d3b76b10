"""Elastic jobs: the driver's records (:mod:`hvdp.launch.elastic_driver`) as messages for the user."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Dict, List, Optional, Tuple

from hvdp.launch.watch import JobWatcher, describe_exit

#: Seconds between reminders while an elastic job waits for workers.
WAIT_REMINDER_S = 10.0
#: Seconds an elastic job may wait for its first workers before hvdp run says what it waits for.
START_GRACE_S = 5.0

@dataclass
class Removal:
    """A host the elastic driver blacklisted, and why."""

    host: str
    ranks: List[int]
    codes: List[int]
    until: Optional[float]


class ElasticReporter:
    """Turns the elastic driver's records into messages while the job has too few workers.

    Records (one JSON object per line, from :mod:`hvdp.launch.elastic_driver`): ``exit`` (a
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

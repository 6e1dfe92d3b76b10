"""Supervising a running job: its output, its failures, and all of it ended on a signal.

:func:`supervise` starts the command :func:`hvdp.launch.command.build_command` built and stays
with it until it ends:

- each rank's output and failure record come through :class:`hvdp.launch.relay.Relay` and
  are shown as ``--output`` says; horovodrun's own lines pass through a noise filter, and
  :class:`JobWatcher` reads which ranks failed and why (under ``--mpi``,
  :class:`TagJoiner` puts back together the lines Open MPI cut into tagged pieces);
- SIGTERM, SIGINT and SIGHUP end every process of the job (:mod:`hvdp.launch.stop`) and
  ``hvdp run`` exits with 128 + the signal number after one line saying what it stopped;
- an elastic job runs Horovod's own driver in :mod:`hvdp.launch.elastic_driver`, whose records
  :class:`ElasticReporter` turns into messages.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Dict, List, Optional, Tuple

from hvdp.failures import Failure
from hvdp.launch import worker
from hvdp.launch.elastic import ElasticReporter
from hvdp.launch.relay import SILENT_S, Display, Relay, is_noise, reachable_address, stream_env
from hvdp.launch.stop import (
    GRACE_S,
    JOB_ID_VAR,
    RemoteStop,
    Stopped,
    _and,
    _counted,
    become_subreaper,
    descendants,
    reap_orphans,
    stop_tree,
)
from hvdp.launch.terminal import Terminal
from hvdp.launch.watch import JobWatcher, TagJoiner

#: Signals that end the job (what timeout, systemd, Kubernetes, Docker and a terminal send).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: The start of horovodrun's or mpirun's own account of a failed rank (its exit code, its own traceback).
FAILURE_REPORT = re.compile(r"Process \d+ exit with status code|Terminating remaining workers|"
                            r"Traceback \(most recent call last\)|-{20,}$|Primary job|mpirun (?:noticed|detected)|"
                            r"\[\d+(?:,\d+)?\]<stderr>:(?:Killed|Terminated)$")
#: Seconds to wait, after the job ended, for the last output of its ranks.
DRAIN_S = 5.0


@dataclass
class Output:
    """Where the ranks' output goes: ``--output``, ``--log-dir``, ``--startup-logs``."""

    mode: str = "all"
    log_dir: Optional[str] = None
    startup_logs: bool = False
    #: Remote hosts of the job: the relay listens where they reach it.
    hosts: List[str] = field(default_factory=list)


@dataclass
class SupervisedJob:
    """One job under supervision: what to run and how to watch it."""

    command: List[str]
    env: Dict[str, str]
    mpi: bool = False
    elastic: Optional[ElasticReporter] = None
    events_fd: Optional[int] = None
    remote: Optional[RemoteStop] = None
    grace_s: float = GRACE_S
    received: List[int] = field(default_factory=list)
    #: With it, the command's ranks start through :mod:`hvdp.launch.worker` and report to the relay.
    output: Optional[Output] = None
    #: Where :func:`supervise` wrote; the last lines about the job go there too (on a line of their own).
    terminal: Optional[Terminal] = None
    #: A rank silent this long (no output, no heartbeat: paused, or cut off) ends the job; 0: never
    #: (elastic jobs: Horovod's driver replaces a lost worker).
    silence_s: float = 0.0
    #: Says how the job ended (its exit code, the watcher), when it ended by itself or a silent rank
    #: ended it: called before anything of the job is stopped, so that its line is out first.
    on_end: Optional[Callable[[int, JobWatcher], None]] = None


def traceback_block(failure: Failure) -> str:
    """The lines ``hvdp run`` prints for a rank's recorded exception."""
    where = f" on {failure.host}" if failure.host else ""
    lines = failure.traceback.rstrip("\n").splitlines() or [f"{failure.type}: {failure.message}"]
    return f"hvdp: rank {failure.rank}{where}:\n" + "".join(f"[{failure.rank}] {line}\n" for line in lines)


def supervise(job: SupervisedJob, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> Tuple[int, JobWatcher]:
    """Run ``job.command``, relay its output, and end all of it on SIGTERM, SIGINT or SIGHUP.

    Returns:
        The exit code (128 + the signal number when a signal ended the job) and the watcher.
    """
    become_subreaper()
    watcher = job.elastic.watcher if job.elastic is not None else JobWatcher()
    settings = job.output or Output()
    terminal = job.terminal = Terminal(out, err)
    display = Display(terminal, settings.mode, settings.log_dir, quiet=not settings.startup_logs)
    relay: Optional[Relay] = None
    if job.output is not None:
        def on_failure(failure: Failure) -> None:
            watcher.failure(failure)
            if job.elastic is not None and not failure.consequence:  # the job goes on: say it now
                terminal.line("stderr", traceback_block(failure).encode())

        relay = Relay(display, on_line=lambda rank, stream, line: watcher.feed(f"[{rank}]<{stream}>:{line}\n"),
                      on_failure=on_failure, on_exit=watcher.exit,
                      on_lost=watcher.lost if job.elastic is None else None)
        bind, host = reachable_address(settings.hosts)
        relay.start(bind)
        job.env = {**job.env, worker.ADDRESS_VAR: relay.address(host)}
        job.env.update(stream_env(out, err, settings.mode))
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
        held: List[str] = []

        def write(text: str) -> None:
            display.log(-1, text.encode())
            if display.quiet and is_noise(text.rstrip("\n")):
                return
            if relay is not None and job.elastic is None and (held or FAILURE_REPORT.match(text)):
                held.append(text)  # the launcher's account of a failure: shown only if no record tells more
                return
            terminal.line("stdout", text.encode())

        def relay_launcher() -> None:
            joiner = TagJoiner() if job.mpi else None
            for line in process.stdout if process.stdout is not None else ():
                for whole in joiner.feed(line) if joiner is not None else [line]:
                    write(whole)
                    watcher.feed(whole)
            for whole in joiner.flush() if joiner is not None else []:
                write(whole)
                watcher.feed(whole)

        reader = threading.Thread(target=relay_launcher, daemon=True)
        reader.start()
        if job.elastic is not None:
            elastic = job.elastic

            def say(text: str) -> None:
                terminal.line("stderr", (text + "\n").encode())

            elastic.say = say
            threading.Thread(target=elastic.remind, args=(stop,), daemon=True).start()
        def end_everything() -> Stopped:
            stopped = stop_tree(job.grace_s, keep=[process.pid], urgent=urgent, remote=job.remote)
            process.wait()
            reader.join(timeout=2)
            return stopped

        while process.poll() is None and not stop.wait(0.2):
            reap_orphans(keep=[process.pid])
            quiet = relay.silent(job.silence_s) if relay is not None and job.silence_s else []
            if quiet:  # nothing else would end the job before the ranks' own timeouts
                for rank, host, last in quiet:
                    watcher.silent(rank, host, last, time.time() - last)
                if job.on_end is not None:
                    job.on_end(1, watcher)
                end_everything()
                return 1, watcher
        if stop.is_set():
            signum = job.received[0]
            name = signal.Signals(signum).name
            known = watcher.cause(before=time.time()) if job.elastic is None else None
            if known is not None:  # a rank had failed before the signal (e.g. Compose stops all on a worker's exit)
                rank, why, _ = known
                terminal.line("stderr", f"hvdp: the job failed: rank {rank} {why}; then hvdp run was stopped by "
                                        f"{name}.\n".encode(), final=True)
            stopped = end_everything()
            if relay is not None:
                relay.wait(2)
            killed = f"; SIGKILL for {_and(_counted(stopped.killed))}" if stopped.killed else ""
            left = f"; still running: pids {stopped.left}" if stopped.left else ""
            terminal.line("stderr", f"hvdp run: stopped by {name}: ended {stopped.describe()} in "
                                    f"{stopped.seconds:.1f} s{killed}{left}.\n".encode(), final=True)
            return 128 + signum, watcher
        returncode = process.wait()
        ended = time.time()
        # The job's last output; a signal now (Compose stopping this container) cuts the wait short.
        waited = time.monotonic()
        while reader.is_alive() and time.monotonic() - waited < 10 and not stop.is_set():
            reader.join(timeout=0.05)
        if relay is not None:
            relay.wait(DRAIN_S, cancel=stop)
            if returncode != 0 and job.elastic is None:  # a rank still connected but long silent: the cause
                for rank, host, last in relay.silent(SILENT_S, now=ended):
                    watcher.silent(rank, host, last, ended - last)
        if held and (returncode == 0 or watcher.cause() is None):
            terminal.line("stdout", "".join(held).encode(), final=True)
        if job.on_end is not None:  # before anything left is stopped
            job.on_end(returncode, watcher)
        # Nothing of the job outlives it (e.g. workers an elastic driver left behind).
        if descendants():
            stop_tree(job.grace_s, keep=[process.pid])
        return returncode, watcher
    finally:
        if relay is not None:
            relay.close()
        display.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def job_env(env: Dict[str, str], job_id: str) -> Dict[str, str]:
    """The environment of a supervised job: the caller's, hvdp's additions, and the job's id."""
    return {**os.environ, **env, JOB_ID_VAR: job_id}



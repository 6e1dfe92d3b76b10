"""``hvdp run``: parse, build, start under supervision, and say how the job ended."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from typing import List

from hvdp.launch import supervise
from hvdp.launch.args import parse_run_args
from hvdp.launch.command import build_command, horovodrun_path, in_process, resolve_hosts, with_bootstrap
from hvdp.launch.elastic import ElasticReporter
from hvdp.launch.hosts import check_discovery_script, hosts_line, local_addresses
from hvdp.launch.stop import RemoteStop
from hvdp.launch.watch import JobWatcher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The CLI's ``run`` subparser takes every word after ``run`` as it is, for :func:`run` to parse.

    ``hvdp run`` parses its own argv (:func:`~hvdp.launch.args.parse_run_args`: its help,
    and the flags it passes on to horovodrun), so no word is an option of this parser,
    not even ``--help``.

    Example:
        >>> parser = argparse.ArgumentParser(prog="hvdp run")
        >>> add_arguments(parser)
        >>> parser.parse_args(["-np", "2", "--help"]).argv
        ['-np', '2', '--help']
    """
    parser.prefix_chars = ""
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="hvdp run's arguments (see hvdp run --help)")


def main(args: argparse.Namespace) -> int:
    """``hvdp run`` for the words :func:`add_arguments` collected: :func:`run` on them."""
    return run(args.argv)


def run(argv: List[str]) -> int:
    """Parse, build and start the job; return its exit code (non-zero, with a summary, on failure).

    The job runs under :func:`hvdp.launch.supervise.supervise`: every rank's output comes
    through the relay (``--output``, ``--log-dir``), a failure is named in one line with the
    failed rank's traceback, and SIGTERM, SIGINT or SIGHUP end every process of it.
    """
    args = parse_run_args(argv)
    command, env = build_command(args, os.environ, os.cpu_count() or 1, horovodrun_path())
    found = []
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
    # The ranks start through the bootstrap that sends their output and failures to hvdp run.
    command = with_bootstrap(command, args)
    job = supervise.SupervisedJob(command=in_process(command), env=supervise.job_env(env, job_id),
                                  mpi=args.controller == "mpi",
                                  silence_s=0.0 if args.elastic else float(args.stall_timeout))
    hosts, _ = (None, "") if args.elastic else resolve_hosts(args, os.environ)
    listed = [name for name, _ in (found if args.elastic else hosts or [])]
    remote = sorted(set(listed) - local_addresses())
    job.output = supervise.Output(mode=args.output, log_dir=args.log_dir, startup_logs=args.startup_logs,
                                  hosts=remote)
    if remote and not args.elastic:
        job.remote = RemoteStop(remote, job_id, args.ssh_port, args.ssh_identity_file)
    reader = None
    if args.elastic:
        script = args.discovery_script or ""

        def list_hosts() -> str:
            return hosts_line(check_discovery_script(script, timeout_s=10))

        job.elastic = ElasticReporter(args.min_np or 1, JobWatcher(), list_hosts,
                                      say=lambda text: print(text, file=sys.stderr, flush=True))
        read_fd, job.events_fd = os.pipe()
        # Horovod's own driver, reporting what it decides (hvdp/launch/elastic_driver.py).
        job.command = [sys.executable, "-m", "hvdp.launch.elastic_driver", "--events-fd", str(job.events_fd),
                       *command[1:]]
        reader = threading.Thread(target=job.elastic.read, args=(os.fdopen(read_fd, "r"),), daemon=True)
        reader.start()

    def say_how_it_ended(returncode: int, watcher: JobWatcher) -> None:
        if returncode == 0:
            return
        if reader is not None:
            reader.join(timeout=2)
        final = job.elastic.final_line() if job.elastic is not None else None
        cause = watcher.cause()
        text = final or watcher.summary(returncode)
        if job.elastic is None and cause is not None and cause[2] is not None and not watcher.stalled:
            text = supervise.traceback_block(cause[2]) + text
        if job.terminal is not None:  # after a progress bar rank 0 left mid-line, on a line of its own
            job.terminal.line("stderr", (text + "\n").encode(), final=True)
        else:
            print(text, file=sys.stderr, flush=True)

    # Said before anything of the job is stopped (Compose may stop this container right after).
    job.on_end = say_how_it_ended
    returncode, _ = supervise.supervise(job)
    if reader is not None:
        reader.join(timeout=2)
    return returncode

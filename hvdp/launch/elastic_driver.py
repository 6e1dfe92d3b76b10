"""horovodrun's elastic driver, reporting what it decides to ``hvdp run``.

``hvdp run --elastic`` starts ``python -m hvdp.launch.elastic_driver --events-fd N <horovodrun
arguments>``: Horovod's own command line (``horovod.runner.launch.run_commandline``) in
this process, with a few of the driver's methods wrapped so that, besides doing what they
always do, they write one JSON record per line to file descriptor N:

- ``exit``: a worker process ended (host, slot, rank, exit code);
- ``recorded``: after a failure every worker has reported (failed and ready slots);
- ``blacklisted``: a host was removed (its failed ranks; the end of its cooldown, or none);
- ``waiting``: the driver waits for slots (how many it needs, has, and for how long);
- ``resumed`` / ``timeout``: the wait ended.

:class:`hvdp.launch.elastic.ElasticReporter` reads the records and tells the user.

One repair: when a host is blacklisted while the job waits for slots (too few workers)
and comes back from its cooldown before the wait ends, Horovod 0.28.1 still counts that
host's old slots as running and starts no worker there; the workers left then wait for
ranks that never come (Gloo gives up after 30 s) and the driver hangs. Here the slots of
hosts blacklisted since the last assignment are dropped before the next one, as they are
when the job does not wait, so their workers are started again.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from typing import IO, Any, Callable, Dict, List, Set, Tuple


def install(events: IO[str]) -> None:
    """Wrap the elastic driver's methods so that they report to ``events``."""
    from horovod.runner.common.util.timeout import TimeoutException
    from horovod.runner.elastic import discovery, driver, registration

    lock = threading.Lock()
    failed_ranks: Dict[str, List[int]] = {}
    blacklisted_since: Set[str] = set()

    def emit(**record: Any) -> None:
        with lock:
            try:
                events.write(json.dumps(record) + "\n")
                events.flush()
            except (OSError, ValueError):  # hvdp run has gone: the driver goes on without reporting
                pass

    def wrap(owner: Any, name: str, around: Callable[..., Any]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(original, *args, **kwargs)

        setattr(owner, name, wrapper)

    def wait_for_available_slots(original: Callable[..., Any], self: Any, min_num_proc: int,
                                 min_hosts: int = 1) -> Any:
        current = self._host_manager.current_hosts
        slots = current.count_available_slots()
        short = slots < min_num_proc or len(current.available_hosts) < min_hosts
        if short:
            emit(event="waiting", phase="start" if self._create_worker_fn is None else "resume",
                 min_np=min_num_proc, min_hosts=min_hosts, slots=slots, hosts=len(current.available_hosts),
                 timeout=self._timeout)
        try:
            found = original(self, min_num_proc, min_hosts)
        except TimeoutException as exc:
            emit(event="timeout", message=str(exc))
            raise
        emit(event="resumed", after_wait=short, slots=found.count_available_slots())
        return found

    def handle_worker_exit(original: Callable[..., Any], self: Any, slot_info: Any, exit_code: int,
                           timestamp: float) -> Any:
        emit(event="exit", host=slot_info.hostname, slot=slot_info.local_rank, rank=slot_info.rank,
             code=exit_code)
        return original(self, slot_info, exit_code, timestamp)

    def on_workers_recorded(original: Callable[..., Any], self: Any) -> Any:
        assignments = self._driver.host_assignments
        failed: List[Tuple[str, int]] = sorted(self.get(registration.FAILURE))
        failed_ranks.clear()
        for host, slot in failed:
            slots = assignments.get(host, [])
            failed_ranks.setdefault(host, []).append(slots[slot].rank if slot < len(slots) else -1)
        emit(event="recorded", failed=[[h, s] for h, s in failed],
             ready=[[h, s] for h, s in sorted(self.get(registration.READY))],
             success=self.count(registration.SUCCESS), size=self.size())
        return original(self)

    def blacklist(original: Callable[..., Any], self: Any, host: str) -> Any:
        already = self.is_blacklisted(host)
        result = original(self, host)
        blacklisted_since.add(host)
        if not already:
            until = self._hosts_state[host]._cooldown_period_end_ts
            emit(event="blacklisted", host=host, ranks=failed_ranks.get(host, []), until=until or None)
        return result

    def update_host_assignments(original: Callable[..., Any], self: Any, current_hosts: Any) -> Any:
        for host in list(self._host_assignments):
            if self._host_manager.is_blacklisted(host) or host in blacklisted_since:
                del self._host_assignments[host]  # its workers were stopped: start new ones when it is back
        blacklisted_since.clear()
        return original(self, current_hosts)

    wrap(driver.ElasticDriver, "_update_host_assignments", update_host_assignments)
    wrap(driver.ElasticDriver, "wait_for_available_slots", wait_for_available_slots)
    wrap(driver.ElasticDriver, "_handle_worker_exit", handle_worker_exit)
    wrap(registration.WorkerStateRegistry, "_on_workers_recorded", on_workers_recorded)
    wrap(discovery.HostManager, "blacklist", blacklist)


def main(argv: List[str]) -> None:
    """``--events-fd N`` then horovodrun's arguments."""
    if len(argv) < 2 or argv[0] != "--events-fd" or not argv[1].isdigit():
        raise SystemExit("usage: python -m hvdp.launch.elastic_driver --events-fd N [horovodrun arguments]")
    fd = int(argv[1])
    os.set_inheritable(fd, False)
    install(os.fdopen(fd, "w", buffering=1))
    from hvdp.launch import horovodrun

    horovodrun.main(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])

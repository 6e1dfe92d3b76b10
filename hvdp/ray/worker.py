"""What runs on each Ray Train worker: its environment before the loop (:func:`setup`) and the context
around the loop (:class:`TrainingContext`).

:func:`setup` sets what ``hvdp run`` gives a rank (:mod:`hvdp.launch.command`'s helpers, so both give the
same): Horovod's slot and rendezvous, ``HVDP_FRAMEWORK`` and ``KERAS_BACKEND``, the threads, the stall
timeout, and the network interface Gloo binds to (the one holding the worker's node address).

:class:`TrainingContext` shuts hvdp down when the loop returns, and reads this worker's stderr while the
loop runs: when Horovod's stall inspector (or a direct allreduce that timed out) names the workers that
never joined a collective and the loop then fails, the loop's error becomes a
:class:`hvdp.errors.JobFailedError` naming them, as ``hvdp run`` names stalled ranks.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType
from typing import Any, Dict, List, Optional, Type

#: Each worker's host name in Horovod's slots, in rank order (set by :func:`setup`, for the stall message).
_HOSTS: List[str] = []


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding ``address`` here, or None.

    Example:
        >>> interface_of("127.0.0.1")
        'lo'
    """
    import psutil  # type: ignore[import-untyped]

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None


def setup(env: Dict[str, str], settings: Dict[str, Any], hosts: List[str]) -> None:
    """Give this worker its rank's environment: ``env`` (Horovod's slot and rendezvous), then from
    ``settings`` (``HvdpConfig.to_dict()`` and ``one_node``) what ``hvdp run`` sets for a rank, leaving alone
    what this worker's environment (Ray's ``runtime_env``) sets already, and Gloo's interface. Run on the
    worker by :meth:`hvdp.ray.backend.HvdpBackend.on_start`."""
    import ray

    from hvdp.launch.command import framework_env, stall_env, thread_env
    from hvdp.launch.defaults import horovod_defaults

    environ = os.environ
    framework = settings["framework"]
    update = dict(env)
    update.update(framework_env(framework, environ, f"HvdpConfig(framework={framework!r})"))
    threads = settings.get("threads_per_worker")
    if threads is None:
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    # Ray sets OMP_NUM_THREADS for every worker to its CPUs: hvdp's choice, when given, comes first.
    update.update(thread_env(threads, {var: value for var, value in environ.items() if var != "OMP_NUM_THREADS"}))
    if "HOROVOD_GLOO_TIMEOUT_SECONDS" not in environ:
        update["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(settings.get("start_timeout", 60))
    update.update(stall_env(settings.get("stall_timeout", 300), environ))
    # The values hvdp run measured for one machine; the allocator's take effect only at a process's start.
    update.update({var: value for var, value in horovod_defaults(
        "gloo", framework, bool(settings.get("one_node")), environ).items() if var.startswith("HOROVOD_")})
    nic = interface_of(ray.util.get_node_ip_address())
    if nic is not None and "HOROVOD_GLOO_IFACE" not in environ:
        update["HOROVOD_GLOO_IFACE"] = nic
    environ.update(update)
    if "torch" in sys.modules:  # imported already (by Ray): the variable alone comes too late
        sys.modules["torch"].set_num_threads(int(environ["OMP_NUM_THREADS"]))
    _HOSTS[:] = hosts


class _StderrWatch:
    """Copies fd 2 through a pipe to where it went, feeding every line to :class:`JobWatcher`."""

    def __init__(self) -> None:
        from hvdp.launch.watch import JobWatcher

        self.watcher = JobWatcher()
        self._saved = os.dup(2)
        read_end, write_end = os.pipe()
        sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = threading.Thread(target=self._pump, args=(read_end,), daemon=True, name="hvdp-stderr")
        self._thread.start()

    def _pump(self, read_end: int) -> None:
        pending = b""
        while True:
            try:
                data = os.read(read_end, 65536)
            except OSError:
                data = b""
            if not data:
                break
            try:
                os.write(self._saved, data)
            except OSError:  # where stderr went is gone: keep reading, for the stall report
                pass
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.watcher.feed(line.decode(errors="replace") + "\n")
        os.close(read_end)

    def stop(self) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # the pipe's last writer closes: the pump sees its end
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else a child process still holds the pipe: the pump goes on
            os.close(self._saved)


def stall_message(stalled: Dict[int, str], hosts: List[str], stall_timeout: int) -> str:
    """The attempt's end in words: which workers never joined which collectives.

    Example:
        >>> stall_message({1: "allreduce.w"}, ["10.0.0.1", "10.0.0.2"], 10)[:64]
        'hvdp: the attempt was ended: worker 1 (rank 1, node 10.0.0.2) ne'
    """
    named = "; ".join(f"worker {rank} (rank {rank}, node {hosts[rank] if rank < len(hosts) else '?'}) never "
                      f"submitted {tensors}" for rank, tensors in sorted(stalled.items()))
    return (f"hvdp: the attempt was ended: {named} (stalled longer than HvdpConfig(stall_timeout="
            f"{stall_timeout})). Every worker must make the same collective calls in the same order.")


class TrainingContext:
    """Around the training function on each worker: see the module. Built by ``HvdpConfig.train_func_context``.

    Example:
        >>> with TrainingContext(0):  # stall_timeout 0: nothing is watched
        ...     pass
    """

    def __init__(self, stall_timeout: int) -> None:
        self.stall_timeout = stall_timeout
        self._watch: Optional[_StderrWatch] = None

    def __enter__(self) -> "TrainingContext":
        if self.stall_timeout > 0:
            self._watch = _StderrWatch()
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        import hvdp
        from hvdp.errors import JobFailedError

        try:
            if kind is None and hvdp.is_initialized():
                hvdp.shutdown()  # every worker gets here once its loop ends: Horovod ends with the group
        finally:
            watch, self._watch = self._watch, None
            if watch is not None:
                watch.stop()
        if error is not None and watch is not None and watch.watcher.stalled:
            raise JobFailedError(stall_message(watch.watcher.stalled, _HOSTS, self.stall_timeout)) from error

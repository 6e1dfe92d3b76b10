""":class:`HvdpConfig`: the Ray Train ``BackendConfig`` that makes a worker group an hvdp job.

Ray Train builds the backend from the config (``backend_cls``) on its controller, calls its
``on_start`` once the worker group is up, and wraps the training function in ``train_func_context``
on every worker: :mod:`hvdp.ray.backend` and :mod:`hvdp.ray.worker` do each part.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

from ray.train.backend import BackendConfig
from ray.train.v2._internal.util import TrainingFramework

from hvdp import _runtime
from hvdp.launch.args import DEFAULT_STALL_TIMEOUT
from hvdp.ray.backend import HvdpBackend
from hvdp.ray.worker import TrainingContext

#: How long (s) the workers wait for each other in Gloo's rendezvous (``hvdp.init()``) by default.
DEFAULT_START_TIMEOUT = 60


def _whole(name: str, value: object, least: int, fix: str) -> int:
    """``value`` if it is an int of at least ``least``, else a TypeError/ValueError naming ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HvdpConfig({name}={value!r}): expected a whole number of {fix}, got "
                        f"{type(value).__name__}. Pass e.g. {name}={max(least, 1) * 10}.")
    if value < least:
        raise ValueError(f"HvdpConfig({name}={value!r}): expected {least} or more {fix}. "
                         f"Pass e.g. {name}={max(least, 1) * 10}.")
    return value


class HvdpConfig(BackendConfig):
    """Ray Train's backend config for hvdp: every worker becomes a rank of one Horovod (Gloo) job.

    Args:
        framework: ``"torch"`` or ``"tensorflow"`` (Keras 3 runs on it), as ``hvdp run --framework``:
            ``HVDP_FRAMEWORK`` and ``KERAS_BACKEND`` on every worker.
        stall_timeout: seconds a collective may wait for a worker that does not join it before the
            attempt ends naming that worker (``hvdp run --stall-timeout``); 0 turns the check off.
        threads_per_worker: the compute threads of each worker (``OMP_NUM_THREADS``,
            ``TF_NUM_INTRAOP_THREADS``); None: the CPUs Ray gives each worker
            (``ScalingConfig(resources_per_worker={"CPU": n})``, 1 by default).
        start_timeout: seconds the workers wait for each other in ``hvdp.init()`` (Gloo's rendezvous,
            ``HOROVOD_GLOO_TIMEOUT_SECONDS``).

    Ray reads ``framework`` as its own ``TrainingFramework``; the name given is ``framework_name``.

    Example:
        >>> config = HvdpConfig(framework="torch", stall_timeout=60)
        >>> config.framework_name, config.stall_timeout, config.threads_per_worker
        ('torch', 60, None)
    """

    def __init__(self, framework: str = "torch", *, stall_timeout: int = DEFAULT_STALL_TIMEOUT,
                 threads_per_worker: Optional[int] = None, start_timeout: int = DEFAULT_START_TIMEOUT) -> None:
        self.framework_name: str = _runtime.check_name(framework, "HvdpConfig(framework=...)")
        self.stall_timeout: int = _whole("stall_timeout", stall_timeout, 0, "seconds (0 turns the check off)")
        self.threads_per_worker: Optional[int] = (
            None if threads_per_worker is None else _whole("threads_per_worker", threads_per_worker, 1, "threads"))
        self.start_timeout: int = _whole("start_timeout", start_timeout, 1, "seconds")

    @property
    def backend_cls(self) -> type:
        return HvdpBackend

    @property
    def train_func_context(self) -> Callable[[], Any]:
        return functools.partial(TrainingContext, self.stall_timeout)

    @property
    def framework(self) -> TrainingFramework:
        """Ray's name of the framework (Ray records it with the run)."""
        return TrainingFramework(self.framework_name)

    def to_dict(self) -> Dict[str, Any]:
        """The fields, as Ray records a backend config with its run."""
        return {"framework": self.framework_name, "stall_timeout": self.stall_timeout,
                "threads_per_worker": self.threads_per_worker, "start_timeout": self.start_timeout}

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in self.to_dict().items())
        return f"HvdpConfig({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HvdpConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

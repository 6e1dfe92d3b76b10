"""hvdp on Ray Train: :class:`HvdpConfig`, a Ray Train backend, and :class:`HvdpTrainer` over it.

Ray Train starts the workers, places them on the cluster's nodes, restarts the group after a failure
and keeps the checkpoints; hvdp's backend gives every worker what ``hvdp run`` gives a rank (Horovod's
Gloo rendezvous, rank, size, local and cross ranks from the workers' nodes, the framework, the threads,
the stall timeout), so that ``hvdp.init()`` inside the training function starts the job. Needs Ray
(``pip install 'hvdp[ray]'``, Ray pinned: its backend API is a DeveloperAPI). Importing :mod:`hvdp`
does not import this package.

Example:
    >>> from hvdp.ray import HvdpConfig
    >>> HvdpConfig(framework="tensorflow").framework_name
    'tensorflow'
"""

from __future__ import annotations

#: The Ray release hvdp's backend is written and tested against (setup.py's ``ray`` extra).
RAY_VERSION = "2.60.0"
_INSTALL = f"pip install 'hvdp[ray]' (ray[train]=={RAY_VERSION})"

try:
    import ray
    import ray.train
except ImportError as exc:
    raise ImportError(f"hvdp.ray needs Ray Train, which cannot be imported here ({exc}). "
                      f"Install it: {_INSTALL}.") from exc

if ray.__version__ != RAY_VERSION:
    raise ImportError(f"hvdp.ray is written for Ray {RAY_VERSION} (its backend API may change between minor "
                      f"releases) but Ray {ray.__version__} is installed. Install the pinned one: {_INSTALL}.")

from hvdp.ray.config import HvdpConfig  # noqa: E402
from hvdp.ray.trainer import HvdpTrainer  # noqa: E402

__all__ = ["RAY_VERSION", "HvdpConfig", "HvdpTrainer"]

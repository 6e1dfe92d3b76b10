"""What hvdp knows about a framework without importing it: a :class:`FrameworkSpec` per framework.

``hvdp build`` and ``hvdp doctor`` read these (through :mod:`hvdp.frameworks`)
to learn a framework's distributions, Horovod build flag and probes (the changes to
Horovod's source for it are ``hvdp build``'s, in :mod:`hvdp.horovod_build.patches`);
the backends themselves (the packages ``hvdp/backends/torch/``, ``tensorflow/``) import the framework
and are loaded only by ``hvdp.init``. This module imports nothing from hvdp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class FrameworkSpec:
    """A framework as seen from outside a job: how it is installed, built into Horovod and probed.

    Attributes:
        name: hvdp's name for it (``hvdp.init(framework=name)``).
        distributions: the PyPI distributions that install it, the usual one first.
        requirement: the pinned requirement hvdp is tested with (``pip install hvdp[name]``).
        horovod_flag: Horovod's build switch, ``HOROVOD_WITH_<flag>`` / ``HOROVOD_WITHOUT_<flag>``.
        horovod_module: the module of Horovod's layer for it.
        backend_module: hvdp's adapter for it (:class:`~hvdp.backends.base.Backend`), loaded by ``hvdp.init``.
        cuda_probe: Python that prints something non-empty when the installed build has CUDA.
        gpu_count_probe: Python run with ``facts`` (a dict) in scope, setting ``facts['gpus']``.
        bench_native: ``hvdp bench``'s contender for the framework's own data parallelism.
        bench_env: variables every ``hvdp bench`` job of the framework gets, unless already set.
    """

    name: str
    distributions: Tuple[str, ...]
    requirement: str
    horovod_flag: str
    horovod_module: str
    backend_module: str
    cuda_probe: str = ""
    gpu_count_probe: str = ""
    bench_native: str = ""
    bench_env: Tuple[Tuple[str, str], ...] = ()

"""The frameworks hvdp supports, as :class:`~hvdp.frameworks.spec.FrameworkSpec` objects, imported lightly.

Tools that must not import torch or TensorFlow (``hvdp build``, ``hvdp doctor``) ask
this registry what a framework is called, how it is installed and built into Horovod.

Example:
    >>> [spec.horovod_flag for spec in SPECS.values()]
    ['PYTORCH', 'TENSORFLOW']
"""

from __future__ import annotations

import importlib.metadata
from typing import Dict, Optional

from hvdp.frameworks import tensorflow, torch
from hvdp.frameworks.spec import FrameworkSpec

#: Every supported framework by hvdp name, in the order hvdp lists them.
SPECS: Dict[str, FrameworkSpec] = {spec.name: spec for spec in (torch.SPEC, tensorflow.SPEC)}


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first distribution found among ``names``."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> Dict[str, str]:
    """The supported frameworks installed here, by hvdp name, with their versions (nothing imported)."""
    found = {name: dist_version(*spec.distributions) for name, spec in SPECS.items()}
    return {name: version for name, version in found.items() if version}

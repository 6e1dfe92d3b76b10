"""What ``hvdp build`` is asked to build."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class BuildOptions:
    """What to build. ``frameworks`` None means every supported one installed."""

    frameworks: Optional[Sequence[str]] = None
    gpu: bool = False
    xla: bool = False
    mpi: bool = True
    force: bool = False
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)

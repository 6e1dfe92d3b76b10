"""Where ``hvdp build`` keeps what it made, and the key a cached wheel is found by.

The key is a hash of everything that changes the Horovod binary (see
:func:`hvdp.horovod_build.build.build_inputs`); a wheel is reused only under the same key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

#: Where the record of the installed build lives, inside the horovod package.
BUILD_RECORD = "hvdp_build.json"


def cache_dir() -> Path:
    """``$HVDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdp``, else ``~/.cache/hvdp``."""
    explicit = os.environ.get("HVDP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hvdp"


def patches_digest(patches: Sequence[Any]) -> str:
    """A short hash of ``patches``' text: a changed patch changes the cache key of the builds it is in."""
    blob = json.dumps([[p.path, p.old, p.new] for p in patches]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_key(inputs: Dict[str, object]) -> str:
    """A short stable hash of the build inputs.

    Example:
        >>> cache_key({"horovod": "0.28.1"}) == cache_key({"horovod": "0.28.1"})
        True
    """
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def site_dir(module: str) -> Optional[Path]:
    """The folder of the installed package ``module``, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_record() -> Optional[Dict[str, object]]:
    """The record ``hvdp build`` left beside the installed Horovod, if any."""
    package = site_dir("horovod")
    if package is None or not (package / BUILD_RECORD).exists():
        return None
    loaded: Dict[str, object] = json.loads((package / BUILD_RECORD).read_text())
    return loaded

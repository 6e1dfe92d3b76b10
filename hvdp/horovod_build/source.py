"""Horovod's source distribution: downloaded once from PyPI, checked, unpacked and patched."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable, List, Sequence

from hvdp.errors import BuildError
from hvdp.horovod_build.cache import cache_dir
from hvdp.horovod_build.patches import PATCHES, Patch

HOROVOD_VERSION = "0.28.1"
SDIST_NAME = f"horovod-{HOROVOD_VERSION}.tar.gz"
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"

Progress = Callable[[str], None]


def fetch_sdist(progress: Progress) -> Path:
    """Horovod's source distribution, downloaded once and checked against its hash."""
    target = cache_dir() / "sdist"
    path = target / SDIST_NAME
    if not path.exists():
        target.mkdir(parents=True, exist_ok=True)
        progress(f"Downloading {SDIST_NAME} from PyPI ...")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"horovod=={HOROVOD_VERSION}", "-d", str(target)],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0 or not path.exists():
            raise BuildError(
                f"Could not download horovod=={HOROVOD_VERSION} source from PyPI:\n"
                f"{result.stderr.strip()[-2000:]}\nFix: check the network, or put {SDIST_NAME} in {target}."
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(
            f"{path} has sha256 {digest}, expected {SDIST_SHA256}. "
            f"Delete it and run hvdp build again."
        )
    return path


def unpack_sdist(sdist: Path, into: Path) -> Path:
    """Unpack ``sdist`` into ``into``; the source's root folder."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 (and 3.8-3.10 security releases)
            archive.extractall(into, filter="data")
        else:  # Debian 12's Python 3.11.2: the sdist's hash was checked in fetch_sdist
            archive.extractall(into)
    return into / f"horovod-{HOROVOD_VERSION}"


def patch_source(root: Path, patches: Sequence[Patch] = PATCHES) -> List[str]:
    """Apply ``patches`` under ``root``; each must match exactly once. Returns what changed."""
    done = []
    for patch in patches:
        path = root / patch.path
        text = path.read_text()
        count = text.count(patch.old)
        if count != 1:
            raise BuildError(
                f"Cannot patch {patch.path}: expected the line {patch.old!r} once, found it "
                f"{count} times. This hvdp supports horovod=={HOROVOD_VERSION} sources only."
            )
        path.write_text(text.replace(patch.old, patch.new))
        done.append(f"{patch.path}: {patch.why}")
    return done

"""Fixtures the one-process tests share."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Callable

import pytest

from hvdp.horovod_build import build


@pytest.fixture(scope="module")
def unpack_sdist(tmp_path_factory) -> Callable[[str], Path]:
    """Unpacks the real Horovod sdist (downloaded once by hvdp build, then cached) into a new folder."""
    sdist = build.fetch_sdist(progress=lambda line: None)

    def unpack(name: str) -> Path:
        root = tmp_path_factory.mktemp(name)
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
        return root / f"horovod-{build.HOROVOD_VERSION}"

    return unpack

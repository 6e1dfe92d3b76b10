"""The code stays typed and clean: mypy on the package, ruff on everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ruff_is_clean():
    out = subprocess.run([str(BIN / "ruff"), "check", "hvdp", "tests", "examples"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean():
    out = subprocess.run([sys.executable, "-m", "mypy", "hvdp"], cwd=REPO, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr

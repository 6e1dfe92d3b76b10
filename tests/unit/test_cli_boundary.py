"""The hvdp command's boundary: --version, and bad options as one clear line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import hvdp

HVDP = [sys.executable, "-m", "hvdp.cli"]


def test_version_prints_the_package_version():
    proc = subprocess.run([*HVDP, "--version"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hvdp {hvdp.__version__}"


def test_build_refuses_zero_jobs_in_one_line_without_starting():
    proc = subprocess.run([*HVDP, "build", "-j", "0"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("hvdp: error: --jobs 0 must be at least 1 (the number of parallel compile "
                                   "jobs); leave it out to use every core.")
    assert "Traceback" not in proc.stderr and proc.stdout == ""

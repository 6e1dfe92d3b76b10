"""The tools a Horovod build needs on this machine (CMake, a C++ compiler, MPI), and their versions."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional

from hvdp.errors import BuildError
from hvdp.horovod_build.options import BuildOptions

APT_FIX = "apt-get update && apt-get install -y {packages}"


def first_line(argv: List[str]) -> Optional[str]:
    """The first line ``argv`` prints (stdout, else stderr), or None when it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def mpi_version() -> Optional[str]:
    """``mpirun --version``'s first line, or None when MPI is not installed."""
    return first_line(["mpirun", "--version"]) if shutil.which("mpirun") else None


def compiler() -> str:
    """The C++ compiler CMake will use."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or ""


def check_toolchain(options: BuildOptions) -> None:
    """Raise BuildError naming each missing tool and the command that installs it."""
    missing: List[str] = []
    packages: List[str] = []
    if not shutil.which("cmake"):
        missing.append("cmake")
        packages.append("cmake")
    if not compiler():
        missing.append("a C++ compiler (g++)")
        packages.append("g++")
    if options.mpi and not (shutil.which("mpicxx") and shutil.which("mpirun")):
        missing.append("MPI (mpirun and mpicxx)")
        packages += ["openmpi-bin", "libopenmpi-dev"]
    if missing:
        raise BuildError(
            f"Cannot build Horovod: {', '.join(missing)} not found. Fix: "
            f"{APT_FIX.format(packages=' '.join(packages))}"
            + ("  (or build without MPI: hvdp build --no-mpi)" if options.mpi else "")
        )

"""The steps of compiling Horovod: its build environment, ``pip wheel`` with progress, installing the wheel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from hvdp.errors import BuildError
from hvdp.frameworks import SPECS
from hvdp.horovod_build.cache import BUILD_RECORD, site_dir
from hvdp.horovod_build.options import BuildOptions

#: Python packages Horovod's setup.py imports (we build without isolation).
BUILD_REQUIREMENTS = ["cloudpickle", "psutil", "pyyaml", "packaging", "setuptools", "wheel"]

Progress = Callable[[str], None]


def build_environment(options: BuildOptions, frameworks: Dict[str, str], environ: Mapping[str, str],
                      gpu_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment ``pip wheel`` builds Horovod in: ``environ`` plus hvdp's settings.

    ``gpu_env`` (from :func:`gpu_environment`) is required with ``options.gpu``.

    Example:
        >>> env = build_environment(BuildOptions(jobs=2), {"torch": "2.13.0"}, {})
        >>> env["HOROVOD_WITH_PYTORCH"], env["HOROVOD_WITHOUT_TENSORFLOW"], env["MAKEFLAGS"]
        ('1', '1', '-j2')
    """
    if options.gpu and not gpu_env:
        raise BuildError("build_environment: --gpu needs the NCCL settings of gpu_environment().")
    env = dict(environ)
    if options.gpu and gpu_env:
        env.update(gpu_env)
        # torch.utils.cpp_extension (which Horovod's CMake asks whether torch has CUDA) reads CUDA_HOME.
        env["CUDA_HOME"] = gpu_env["HOROVOD_CUDA_HOME"]
    env.update({
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "MAKEFLAGS": f"-j{options.jobs}",
        "HVDP_WITH_XLA_OPS": "1" if options.xla else "0",
    })
    env["HOROVOD_WITH_MPI" if options.mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    for name, spec in SPECS.items():
        flag = spec.horovod_flag
        env[f"HOROVOD_WITH_{flag}" if name in frameworks else f"HOROVOD_WITHOUT_{flag}"] = "1"
    return env


def wheel_command(source: Path, out: Path) -> List[str]:
    """The command that compiles Horovod's patched ``source`` into a wheel in ``out``.

    Without build isolation: Horovod's build imports the installed torch and TensorFlow.
    """
    return pip("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(out), str(source))



def run_logged(argv: List[str], env: Dict[str, str], log: Path, progress: Progress, every: float = 30.0) -> None:
    """Run ``argv`` with its output in ``log``, reporting progress; BuildError on failure."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        last = start
        while proc.poll() is None:
            time.sleep(1.0)
            if time.monotonic() - last >= every:
                last = time.monotonic()
                steps = re.findall(r"\[\s*(\d+)%\]", log.read_text(errors="replace")[-20000:])
                where = f", compiling {steps[-1]}%" if steps else ""
                progress(f"  ... {time.monotonic() - start:.0f} s{where} (log: {log})")
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"Building Horovod failed (exit {proc.returncode}). Last lines of {log}:\n{tail}")


def pip(*args: str) -> List[str]:
    """``python -m pip ARGS`` for this Python."""
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


def install_wheel(wheel: Path, record: Dict[str, object], progress: Progress) -> None:
    """Install ``wheel`` into this Python and leave a record of the build beside it."""
    progress(f"Installing {wheel.name} ...")
    result = subprocess.run(pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel)),
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"pip could not install {wheel}:\n{result.stderr.strip()[-2000:]}")
    package = site_dir("horovod")
    if package is None:
        raise BuildError(f"{wheel.name} installed but horovod cannot be found by {sys.executable}.")
    (package / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))



def install_requirements(progress: Progress) -> None:
    """Install what Horovod's setup.py imports (the build runs without isolation)."""
    progress("Installing build requirements ...")
    result = subprocess.run(pip("install", "-q", *BUILD_REQUIREMENTS), capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise BuildError(f"pip could not install Horovod's build requirements "
                         f"({', '.join(BUILD_REQUIREMENTS)}):\n{result.stderr.strip()[-2000:]}")

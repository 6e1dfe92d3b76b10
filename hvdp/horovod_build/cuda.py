"""What ``hvdp build --gpu`` needs: CUDA builds of the frameworks, a CUDA toolkit with nvcc, and NCCL.

The toolkit and NCCL are looked for where people install them (``CUDA_HOME``, ``nvcc``
on ``PATH``, PyPI's CUDA wheels, Debian's packages, /usr/local/cuda); PyPI's wheels are
not laid out as a toolkit, so a folder of links is made for them in the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hvdp.errors import BuildError
from hvdp.frameworks import SPECS
from hvdp.horovod_build.cache import cache_dir, site_dir


def framework_cuda_problems(frameworks: Dict[str, str]) -> List[str]:
    """One line per framework in ``frameworks`` that is not a CUDA build (each probed in its own process)."""
    problems: List[str] = []
    for name in frameworks:
        out = subprocess.run([sys.executable, "-c", SPECS[name].cuda_probe], capture_output=True, text=True,
                             check=False)
        if out.returncode != 0 or not out.stdout.strip():
            problems.append(
                f"{name} {frameworks[name]} is not a CUDA build (install a CUDA build of {name}, "
                f"or leave it out: hvdp build --gpu --frameworks "
                f"{','.join(n for n in frameworks if n != name) or '<other>'})"
            )
    return problems


def _toolkit(environ: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    problems: List[str] = []
    cuda_home = find_cuda_home(environ)
    if not cuda_home:
        problems.append("the CUDA toolkit (nvcc) was not found: install it (a CUDA 'devel' image has it) "
                        "or set CUDA_HOME")
    elif not (Path(cuda_home) / "bin" / "nvcc").is_file():
        problems.append(f"CUDA_HOME={cuda_home} has no bin/nvcc: point CUDA_HOME at the CUDA toolkit")
        cuda_home = None
    nccl_home = find_nccl_home(cuda_home, environ)
    if not nccl_home:
        problems.append("NCCL (nccl.h and libnccl) was not found: pip install nvidia-nccl-cu12, "
                        "or apt-get install libnccl-dev, or set HOROVOD_NCCL_HOME")
    if problems or not cuda_home or not nccl_home:
        return {}, problems
    return nccl_environment(cuda_home, nccl_home), []


def toolkit_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Horovod's NCCL build settings for the CUDA toolkit and NCCL found from ``environ``.

    Raises BuildError naming what is missing. Does not look at the frameworks
    (:func:`gpu_environment` does both).
    """
    env, problems = _toolkit(os.environ if environ is None else environ)
    if problems:
        raise BuildError("Cannot build Horovod with --gpu:\n  - " + "\n  - ".join(problems))
    return env


def nccl_environment(cuda_home: str, nccl_home: str) -> Dict[str, str]:
    """The variables that make Horovod's build use NCCL ring all-reduce on CUDA.

    Example:
        >>> nccl_environment("/usr/local/cuda", "/usr")["HOROVOD_GPU_OPERATIONS"]
        'NCCL'
    """
    return {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": cuda_home,
            "HOROVOD_NCCL_HOME": nccl_home, "HOROVOD_NCCL_LINK": "SHARED"}


def gpu_environment(frameworks: Dict[str, str], environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Horovod's NCCL build settings, or BuildError listing everything that is missing."""
    env, problems = _toolkit(os.environ if environ is None else environ)
    problems = framework_cuda_problems(frameworks) + problems
    if problems:
        raise BuildError("Cannot build Horovod with --gpu:\n  - " + "\n  - ".join(problems))
    return env


def find_cuda_home(environ: Mapping[str, str]) -> Optional[str]:
    """``CUDA_HOME`` (or ``HOROVOD_CUDA_HOME``), else the toolkit of the ``nvcc`` on ``PATH``, else
    that of PyPI's nvcc wheel in this environment (see :func:`pip_cuda_home`), else /usr/local/cuda."""
    explicit = environ.get("CUDA_HOME") or environ.get("HOROVOD_CUDA_HOME")
    if explicit:
        return explicit
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if root.parent.name != "nvidia":  # a toolkit installed as such, not a pip wheel's folder
            return str(root)
        return pip_cuda_home(root.parent)
    nvidia = site_dir("nvidia")
    from_pip = pip_cuda_home(nvidia) if nvidia else None
    if from_pip:
        return from_pip
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None


#: Folders of PyPI's CUDA wheels (under site-packages/nvidia) that hold parts of the toolkit.
#: CUDA 13's wheels (nvidia-cuda-nvcc, -runtime, -cccl, -crt, nvidia-nvvm) all unpack into
#: one folder, ``nvidia/cu13``; CUDA 12's each have their own (``cuda_nvcc``, ``cuda_runtime``, ...).
_PIP_CUDA_FOLDER = re.compile(r"cu\d+|cuda_\w+")


def pip_cuda_roots(nvidia: Path) -> List[Path]:
    """The folders under ``nvidia`` that make a CUDA toolkit, the one with ``bin/nvcc`` first.

    Empty when no nvcc wheel is installed. When several CUDA versions are (``cu12``,
    ``cu13``), the newest one that has nvcc and only it.
    """
    if not nvidia.is_dir():
        return []
    folders = sorted(p for p in nvidia.iterdir() if p.is_dir() and _PIP_CUDA_FOLDER.fullmatch(p.name))
    versioned = [p for p in folders if p.name.startswith("cu") and not p.name.startswith("cuda_")]
    with_nvcc = [p for p in versioned if (p / "bin" / "nvcc").is_file()]
    if with_nvcc:
        return [max(with_nvcc, key=lambda p: int(p.name[2:]))]
    split = [p for p in folders if p.name.startswith("cuda_")]
    nvcc = [p for p in split if (p / "bin" / "nvcc").is_file()]
    return nvcc + [p for p in split if p not in nvcc] if nvcc else []


def pip_cuda_home(nvidia: Path) -> Optional[str]:
    """A CUDA_HOME made of links to PyPI's CUDA wheels under ``nvidia``, or None without nvcc.

    The wheels are not laid out as a toolkit: their libraries are in ``lib`` (CMake
    and torch look in ``lib64``) and only versioned (``libcudart.so.13``, no
    ``libcudart.so`` to link with), and CUDA 12's are split over several folders.
    The folder, in the cache and named by the wheels' location, has ``bin``,
    ``nvvm`` and ``include`` with a link per entry, and ``lib64`` (``lib`` links to
    it) with a link per library plus ``libX.so`` for each ``libX.so.N``.
    """
    roots = pip_cuda_roots(nvidia)
    if not roots:
        return None
    tag = hashlib.sha256("\n".join(str(p) for p in roots).encode()).hexdigest()[:12]
    return str(assemble_cuda_home(roots, cache_dir() / "cuda" / f"{roots[0].name}-{tag}"))


def assemble_cuda_home(roots: Sequence[Path], home: Path) -> Path:
    """Fill ``home`` with links to the toolkit parts in ``roots`` (the first one wins a name)."""
    if home.is_symlink() or home.is_file():
        home.unlink()
    elif home.exists():
        shutil.rmtree(home)
    for part in ("bin", "nvvm", "include", "lib64"):
        (home / part).mkdir(parents=True)
    (home / "lib").symlink_to("lib64")
    for root in roots:
        for part, into in (("bin", "bin"), ("nvvm", "nvvm"), ("include", "include"), ("lib", "lib64"),
                           ("lib64", "lib64")):
            source = root / part
            if not source.is_dir() or source.is_symlink():
                continue
            for entry in sorted(source.iterdir()):
                link = home / into / entry.name
                if not (link.exists() or link.is_symlink()):
                    link.symlink_to(entry)
    for library in sorted((home / "lib64").glob("lib*.so.*")):
        plain = library.parent / (library.name.split(".so.")[0] + ".so")
        if not (plain.exists() or plain.is_symlink()):
            plain.symlink_to(library.name)
    return home


def find_nccl_home(cuda_home: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    """A folder with include/nccl.h and lib/libnccl.so.

    Looked for in ``HOROVOD_NCCL_HOME`` (or ``NCCL_HOME``), then the NCCL of
    PyTorch's CUDA wheels (package nvidia-nccl-cu*), /usr (Debian's
    libnccl-dev), and the CUDA toolkit. The pip NCCL ships only
    ``libnccl.so.2``; CMake looks for ``libnccl.so``, so a folder of links is
    made in the cache for it.
    """
    explicit = environ.get("HOROVOD_NCCL_HOME") or environ.get("NCCL_HOME")
    if explicit:
        return explicit
    nvidia = site_dir("nvidia")
    candidates = ([nvidia / "nccl"] if nvidia else []) + [Path("/usr"), Path(cuda_home or "/usr/local/cuda")]
    for home in candidates:
        if not (home / "include" / "nccl.h").exists():
            continue
        libs = [home / "lib", home / "lib" / "x86_64-linux-gnu", home / "lib64"]
        if any((lib / "libnccl.so").exists() for lib in libs):
            return str(home)
        versioned = sorted(p for lib in libs for p in lib.glob("libnccl.so.*"))
        if versioned:
            linked = cache_dir() / "nccl"
            (linked / "lib").mkdir(parents=True, exist_ok=True)
            for link, target in ((linked / "include", home / "include"), (linked / "lib" / "libnccl.so", versioned[0])):
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(target)
            return str(linked)
    return None


"""horovodrun in this process, with its build checks answered once per Horovod install.

Before it starts a job, horovodrun asks whether Horovod was built with Gloo (or MPI):
``horovod.common.util.gloo_built()`` forks a process that imports Horovod's TensorFlow
extension, hence TensorFlow, and only then its answer: 5-7 s of every launch on 2 cores,
for the same answer each time. ``hvdp run`` starts ``python -m hvdp.launch.horovodrun ARGS``
instead of ``horovodrun ARGS``: Horovod's own command line (``run_commandline``) with those
two checks asked of Horovod the first time and kept in hvdp's cache, under a key made of the
extension libraries' paths, sizes and modification times (a rebuilt or reinstalled Horovod
asks again). And Open MPI's OFI transport is left out of the jobs it starts with ``mpirun``
(``-mca btl ^openib,ofi`` for horovodrun's ``^openib``: :data:`hvdp.backends.openmpi.OMPI_BTL_EXCLUDED`, a
deadlock in ``MPI_Init``). Nothing else of horovodrun changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

#: The checks horovodrun's launch path makes (horovod/runner/launch.py: run_controller, _run_elastic).
CHECKS = ("gloo_built", "mpi_built")


def extension_key() -> Optional[str]:
    """A hash of Horovod's installed extension libraries (path, size, mtime), or None without any."""
    import importlib.util

    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    found = []
    for lib in sorted(root.glob("*/mpi_lib*.so")):
        stat = lib.stat()
        found.append(f"{lib}:{stat.st_size}:{stat.st_mtime_ns}")
    if not found:
        return None
    return hashlib.sha256("\n".join(found).encode()).hexdigest()[:16]


def cache_file(key: str) -> Path:
    from hvdp.horovod_build.cache import cache_dir

    return cache_dir() / "build-checks" / f"{key}.json"


def _read(path: Path) -> Dict[str, object]:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, answers: Dict[str, object]) -> None:
    """Atomically; an unwritable cache only means the check is asked again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(answers, sort_keys=True) + "\n")
        os.replace(partial, path)
    except OSError:
        pass


def remembered(original: Callable[..., object], name: str, path: Path) -> Callable[..., object]:
    """``original`` (one of Horovod's build checks), asked once per ``path``: its answer is kept there."""

    def check(verbose: bool = False) -> object:
        answers = _read(path)
        if name not in answers:
            answers[name] = original(verbose=verbose)
            _write(path, {**_read(path), name: answers[name]})
        return answers[name]

    check.__name__ = check.__qualname__ = name
    check.__doc__ = original.__doc__
    return check


def install() -> None:
    """Answer horovodrun's build checks from the cache (where Horovod's extensions are found); Open MPI's
    flags without its OFI transport."""
    from horovod.runner import mpi_run

    from hvdp.backends.openmpi import OMPI_BTL_EXCLUDED

    mpi_run._OMPI_FLAGS = [flag if not flag.startswith("-mca btl ") else f"-mca btl {OMPI_BTL_EXCLUDED}"
                           for flag in mpi_run._OMPI_FLAGS]
    key = extension_key()
    if key is None:  # no extension library: let Horovod's own check say so
        return
    from horovod.common import util
    from horovod.runner import launch

    path = cache_file(key)
    for name in CHECKS:
        check = remembered(getattr(util, name), name, path)
        setattr(util, name, check)
        setattr(launch, name, check)  # launch.py imported the names themselves


def main(argv: Optional[List[str]] = None) -> int:
    """``horovodrun ARGV`` in this process, its build checks cached."""
    install()
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    return int(run_commandline() or 0)


if __name__ == "__main__":
    sys.exit(main())

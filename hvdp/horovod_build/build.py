"""Build Horovod 0.28.1 from its PyPI source for the frameworks installed, and cache the wheel.

Horovod 0.28.1 (the last release) does not build unchanged against current
PyTorch and TensorFlow. :func:`patch_source` makes exactly the changes they
require (:mod:`hvdp.horovod_build.patches`), each checked to apply once:

1. C++17 instead of C++14 (top-level CMakeLists.txt and the torch extension);
   torch >= 2.1 and TensorFlow's absl headers need C++17.
2. TensorFlow's XLA ops (``xla_mpi_ops.cc``) are compiled only when asked
   (``hvdp build --xla``): they need XLA headers the TensorFlow wheel lacks.
3. Gloo contexts of process sets (the global one included) use the network
   interface horovodrun chose (``HOROVOD_GLOO_IFACE``), as the other Gloo
   contexts do; unpatched, they bind to whatever the host name resolves to,
   which is a loopback address on Debian-style hosts (``127.0.1.1``), and a
   multi-host Gloo job dies with "connect [127.0.x.1]: Connection refused".
4. The Gloo controller sizes its list of global ranks (it only reserved room
   for it), so the stall inspector sees every rank; unpatched, under Gloo it
   never reports a stalled rank and never ends a stalled job.
5. Horovod's TensorFlow and Keras layers work on Keras 3
   (:mod:`hvdp.horovod_build.tensorflow_patches`).

The wheel is cached outside the repository under a key made of everything that
changes the binary (:func:`build_inputs`), so a second build with the same inputs
only reinstalls it. Its parts are in :mod:`hvdp.horovod_build`; what differs between
frameworks comes from :mod:`hvdp.frameworks`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from hvdp.errors import BuildError
from hvdp.frameworks import SPECS, installed_versions
from hvdp.horovod_build.cache import cache_dir, cache_key, installed_record, patches_digest
from hvdp.horovod_build.cuda import (
    gpu_environment,
)
from hvdp.horovod_build.options import BuildOptions
from hvdp.horovod_build.patches import GPU_PATCHES, PATCH_LEVEL, PATCHES
from hvdp.horovod_build.source import (
    HOROVOD_VERSION,
    Progress,
    fetch_sdist,
    patch_source,
    unpack_sdist,
)
from hvdp.horovod_build.steps import (
    build_environment,
    install_requirements,
    install_wheel,
    run_logged,
    wheel_command,
)
from hvdp.horovod_build.toolchain import check_toolchain, compiler, first_line, mpi_version


def framework_versions() -> Dict[str, str]:
    """Installed frameworks Horovod can be built for, by hvdp name."""
    return installed_versions()


def build_inputs(options: BuildOptions, frameworks: Dict[str, str]) -> Dict[str, object]:
    """Everything that affects the Horovod binary; the cache key is their hash."""
    cxx = compiler()
    return {
        "horovod": HOROVOD_VERSION,
        "patch_level": PATCH_LEVEL,
        "patches": patches_digest(PATCHES),  # a changed patch text (or inserted module) is a new build
        "python": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "frameworks": dict(sorted(frameworks.items())),
        "mpi": mpi_version() if options.mpi else None,
        "gpu": options.gpu,
        "xla": options.xla,
        "compiler": first_line([cxx, "--version"]) if cxx else None,
        **({"gpu_patches": patches_digest(GPU_PATCHES)} if options.gpu else {}),
        # GPU architectures compiled for (every one nvcc lists when unset): a wheel for one must not serve another.
        **({"cuda_cc_list": os.environ["HOROVOD_BUILD_CUDA_CC_LIST"]}
           if options.gpu and os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST") else {}),
    }


def chosen_frameworks(options: BuildOptions) -> Dict[str, str]:
    """The frameworks to build for, with their installed versions; BuildError naming the fix otherwise."""
    installed = framework_versions()
    wanted = list(options.frameworks) if options.frameworks else list(installed)
    for name in wanted:
        if name not in SPECS:
            raise BuildError(f"Unknown framework {name!r} for --frameworks. Expected: {', '.join(SPECS)}.")
        if name not in installed:
            raise BuildError(
                f"{name} is not installed, so Horovod cannot be built for it. Install it "
                f"(pip install 'hvdp[{name}]') or leave it out of --frameworks."
            )
    if not wanted:
        raise BuildError(f"Neither {' nor '.join(SPECS)} is installed: install one first, "
                         f"e.g. pip install 'hvdp[{next(iter(SPECS))}]'.")
    return {name: installed[name] for name in wanted}


def check_cache_writable() -> None:
    """BuildError naming the folder when the cache (:func:`cache_dir`) cannot be created or written."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"The build cache {root} cannot be created ({exc.strerror}). "
                         f"Set HVDP_CACHE_DIR to a writable folder.") from exc
    if not os.access(root, os.W_OK):
        raise BuildError(f"The build cache {root} is not writable. Set HVDP_CACHE_DIR to a writable folder.")


def build(options: BuildOptions, progress: Progress = print) -> Path:
    """Build (or reuse from cache) and install Horovod; return the wheel's path.

    Example:
        >>> build(BuildOptions(frameworks=["torch"]))  # doctest: +SKIP
    """
    frameworks = chosen_frameworks(options)
    check_cache_writable()
    inputs = build_inputs(options, frameworks)
    key = cache_key(inputs)
    slot = cache_dir() / "wheels" / key
    wheels = sorted(slot.glob("horovod-*.whl")) if slot.exists() else []
    progress(f"Horovod {HOROVOD_VERSION} for {', '.join(f'{n} {v}' for n, v in frameworks.items())}"
             f"{' + NCCL' if options.gpu else ''}; cache key {key}")
    if wheels and not options.force:
        progress(f"Cache hit: {wheels[0]}")
        current = installed_record()
        if current is not None and current.get("key") == key:
            progress("Already installed in this environment; nothing to do (--force rebuilds).")
            return wheels[0]
        install_wheel(wheels[0], {"key": key, "inputs": inputs, "wheel": str(wheels[0])}, progress)
        return wheels[0]

    check_toolchain(options)
    gpu_env = gpu_environment(frameworks) if options.gpu else None
    env = build_environment(options, frameworks, os.environ, gpu_env)
    sdist = fetch_sdist(progress)
    install_requirements(progress)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdp-build-") as tmp:
        wheel = _compile(unpack_sdist(sdist, Path(tmp)), Path(tmp) / "wheel", options, env, key, slot, progress)
    seconds = time.monotonic() - start
    record = {"key": key, "inputs": inputs, "wheel": str(wheel), "build_seconds": round(seconds, 1)}
    (slot / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    progress(f"Built {wheel.name} in {seconds:.0f} s; cached in {slot}")
    install_wheel(wheel, record, progress)
    return wheel


def _compile(source: Path, out: Path, options: BuildOptions, env: Dict[str, str], key: str, slot: Path,
             progress: Progress) -> Path:
    """Patch ``source``, compile it into a wheel and copy the wheel into the cache ``slot``."""
    changes: List[str] = patch_source(source) + (patch_source(source, GPU_PATCHES) if options.gpu else [])
    for change in changes:
        progress(f"Patched {change}")
    log = cache_dir() / "logs" / f"build-{key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    progress(f"Compiling with {options.jobs} jobs (a few minutes on 2 cores) ...")
    run_logged(wheel_command(source, out), env, log, progress)
    built = sorted(out.glob("horovod-*.whl"))
    if not built:
        raise BuildError(f"pip wheel finished but left no wheel in {out}; see {log}.")
    slot.mkdir(parents=True, exist_ok=True)
    wheel = slot / built[0].name
    shutil.copy2(built[0], wheel)
    return wheel

"""hvdp build: cache keys, the source patches on the real sdist, toolchain errors, the cache hit."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hvdp import build
from hvdp.errors import BuildError

REPO = Path(__file__).resolve().parents[2]


def test_cache_key_changes_with_every_input():
    options = build.BuildOptions()
    base = build.build_inputs(options, {"torch": "2.13.0+cpu", "tensorflow": "2.21.0"})
    key = build.cache_key(base)
    assert key == build.cache_key(dict(base))
    for field, value in [("frameworks", {"torch": "2.13.1+cpu", "tensorflow": "2.21.0"}),
                         ("frameworks", {"torch": "2.13.0+cpu"}), ("mpi", None), ("gpu", True),
                         ("xla", True), ("python", "cpython-312-x86_64"), ("patch_level", 99),
                         ("horovod", "0.28.2")]:
        assert build.cache_key({**base, field: value}) != key, field


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The real Horovod sdist (downloaded once by hvdp build and cached), unpacked."""
    sdist = build.fetch_sdist(progress=lambda line: None)
    root = tmp_path_factory.mktemp("src")
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    return root / f"horovod-{build.HOROVOD_VERSION}"


def test_patches_make_cxx17_and_xla_opt_in(source):
    changes = build.patch_source(source)
    assert len(changes) == len(build.PATCHES)
    top = (source / "CMakeLists.txt").read_text()
    torch_cmake = (source / "horovod/torch/CMakeLists.txt").read_text()
    tf_cmake = (source / "horovod/tensorflow/CMakeLists.txt").read_text()
    assert "set(CMAKE_CXX_STANDARD 17)" in top and "CMAKE_CXX_STANDARD 14" not in top
    assert "CMAKE_CXX_STANDARD 14" not in torch_cmake
    assert 'if("$ENV{HVDP_WITH_XLA_OPS}" STREQUAL "1")\n    list(APPEND TF_SOURCES' in tf_cmake
    # Applying the patches twice fails loudly instead of silently doing nothing.
    with pytest.raises(BuildError, match="expected the line .* once, found it 0 times"):
        build.patch_source(source)


def test_missing_toolchain_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(BuildError) as err:
        build.check_toolchain(build.BuildOptions())
    message = str(err.value)
    assert "cmake, a C++ compiler (g++), MPI (mpirun and mpicxx) not found" in message
    assert "apt-get install -y cmake g++ openmpi-bin libopenmpi-dev" in message


def test_gpu_build_on_a_cpu_machine_says_what_is_missing():
    with pytest.raises(BuildError) as err:
        build.gpu_environment({"torch": build.framework_versions()["torch"]})
    assert "torch" in str(err.value) and "is not a CUDA build" in str(err.value)


def test_second_build_is_a_cache_hit():
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "build"], capture_output=True, text=True,
                         cwd=REPO, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Cache hit" in out.stdout and "Compiling" not in out.stdout

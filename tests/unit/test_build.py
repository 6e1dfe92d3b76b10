"""hvdp build: cache keys, the source patches on the real sdist, toolchain errors, the cache hit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hvdp.errors import BuildError
from hvdp.horovod_build import build, patches
from hvdp.horovod_build import cuda as cuda_build

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
    # A patch whose text changed (or a module it inserts) is a new build, even at the same PATCH_LEVEL.
    changed = [patches.Patch(p.path, p.old, p.new + "\n", p.why) if i == 0 else p
               for i, p in enumerate(build.PATCHES)]
    assert base["patches"] == build.patches_digest(build.PATCHES) != build.patches_digest(changed)


@pytest.fixture(scope="module")
def source(unpack_sdist):
    """The real Horovod sdist, unpacked."""
    return unpack_sdist("src")


def test_patches_make_cxx17_and_xla_opt_in(source):
    changes = build.patch_source(source)
    assert len(changes) == len(build.PATCHES)
    top = (source / "CMakeLists.txt").read_text()
    torch_cmake = (source / "horovod/torch/CMakeLists.txt").read_text()
    tf_cmake = (source / "horovod/tensorflow/CMakeLists.txt").read_text()
    assert "set(CMAKE_CXX_STANDARD 17)" in top and "CMAKE_CXX_STANDARD 14" not in top
    assert "CMAKE_CXX_STANDARD 14" not in torch_cmake
    assert 'if("$ENV{HVDP_WITH_XLA_OPS}" STREQUAL "1")\n    list(APPEND TF_SOURCES' in tf_cmake
    gloo = (source / "horovod/common/gloo/gloo_context.cc").read_text()
    process_set_init = gloo[gloo.index("void GlooContext::InitializeForProcessSet"):]
    assert process_set_init.index("gloo_iface_ = global_context.gloo_iface_;") < process_set_init.index(
        "device_attr.iface = gloo_iface_;")
    # Applying the patches twice fails loudly instead of silently doing nothing.
    with pytest.raises(BuildError, match="expected the line .* once, found it 0 times"):
        build.patch_source(source)


def test_keras3_patches_leave_valid_python_that_never_imports_hvdp(tmp_path):
    sdist = build.fetch_sdist(progress=lambda line: None)
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    root = tmp_path / f"horovod-{build.HOROVOD_VERSION}"
    build.patch_source(root)
    changed = sorted({patch.path for patch in patches.KERAS3_PATCHES})
    assert all(path.endswith(".py") for path in changed)
    for path in changed:
        text = (root / path).read_text()
        compile(text, path, "exec")  # a SyntaxError fails the test
        assert not re.search(r"^\s*(import|from)\s+hvdp\b", text, re.M), path
    tape = (root / "horovod/tensorflow/__init__.py").read_text()
    assert "sources = [as_tf_variable(s) for s in sources]" in tape
    keras = (root / "horovod/_keras/__init__.py").read_text()
    create = keras[keras.index("def create_distributed_optimizer("):]
    # Keras 3 optimizers go to the Keras 3 wrapper before Horovod's Keras 2 class is even defined.
    assert create.index("if is_keras3_optimizer(optimizer):") < create.index("class _DistributedOptimizer(")
    assert "def _clip_gradients(self, grads" in keras
    assert "fused=fused" in (root / "horovod/tensorflow/sync_batch_norm.py").read_text()
    assert ".optimizer.lr" not in (root / "horovod/_keras/callbacks.py").read_text()


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


@pytest.mark.slow
def test_hvdp_build_gpu_refuses_here_and_lists_every_missing_piece(tmp_path):
    env = {**os.environ, "HVDP_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    for var in ("CUDA_HOME", "HOROVOD_CUDA_HOME", "HOROVOD_NCCL_HOME", "NCCL_HOME"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "build", "--gpu"], capture_output=True, text=True,
                         cwd=REPO, env=env, check=False, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("hvdp: error: Cannot build Horovod with --gpu:"), out.stderr
    # The frameworks here are CPU builds; each is named with the fix (whether nvcc and NCCL
    # are found depends on the machine: the toolkit tests below cover those messages).
    assert ("torch 2.13.0+cpu is not a CUDA build (install a CUDA build of torch, or leave it out: "
            "hvdp build --gpu --frameworks tensorflow)") in out.stderr
    assert "tensorflow 2.21.0 is not a CUDA build" in out.stderr
    assert "Compiling" not in out.stdout and not (tmp_path / "cache" / "wheels").exists()


def _fake_cuda(root: Path, nccl_libs: tuple) -> Path:
    """A CUDA toolkit layout with NCCL inside: real files (nvcc never runs here)."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "include").mkdir()
    (root / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    for lib in nccl_libs:
        (root / lib).parent.mkdir(parents=True, exist_ok=True)
        (root / lib).write_bytes(b"\x7fELF")
    return root


def test_gpu_build_environment_on_a_cuda_layout(tmp_path, monkeypatch):
    cuda = _fake_cuda(tmp_path / "cuda-12.8", ("lib64/libnccl.so", "lib64/libnccl.so.2"))
    environ = {"PATH": f"{cuda / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    # nvcc found on PATH: its toolkit is CUDA_HOME; NCCL found in the toolkit.
    gpu = cuda_build.toolkit_environment(environ)
    assert gpu == {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": str(cuda),
                   "HOROVOD_NCCL_HOME": str(cuda), "HOROVOD_NCCL_LINK": "SHARED"}
    options = build.BuildOptions(frameworks=["torch", "tensorflow"], gpu=True, jobs=8)
    env = build.build_environment(options, {"torch": "2.13.0+cu128", "tensorflow": "2.21.0"}, environ, gpu)
    assert {k: v for k, v in env.items() if k.startswith(("HOROVOD_", "HVDP_", "MAKEFLAGS"))} == {
        **gpu, "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1", "MAKEFLAGS": "-j8", "HVDP_WITH_XLA_OPS": "0"}
    assert env["PATH"] == environ["PATH"]  # the caller's environment is kept
    command = build.wheel_command(tmp_path / "src", tmp_path / "out")
    assert command[:3] == [sys.executable, "-m", "pip"] and "--no-build-isolation" in command
    assert command[-3:] == ["-w", str(tmp_path / "out"), str(tmp_path / "src")]
    with pytest.raises(BuildError, match="needs the NCCL settings"):
        build.build_environment(options, {"torch": "2.13.0+cu128"}, environ)


def test_pip_nccl_with_only_a_versioned_library_gets_a_folder_of_links(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path / "cache"))
    cuda = _fake_cuda(tmp_path / "cuda", ("lib/libnccl.so.2",))
    gpu = cuda_build.toolkit_environment({"CUDA_HOME": str(cuda), "PATH": "/usr/bin:/bin"})
    linked = Path(gpu["HOROVOD_NCCL_HOME"])
    assert linked == tmp_path / "cache" / "nccl"
    assert (linked / "lib" / "libnccl.so").resolve() == (cuda / "lib" / "libnccl.so.2").resolve()
    assert (linked / "include" / "nccl.h").read_text() == "#define NCCL_MAJOR 2\n"


def test_cuda_home_without_nvcc_and_missing_nccl_are_named(tmp_path):
    (tmp_path / "not-cuda").mkdir()
    with pytest.raises(BuildError) as err:
        cuda_build.toolkit_environment({"CUDA_HOME": str(tmp_path / "not-cuda"), "PATH": "/usr/bin:/bin"})
    assert f"CUDA_HOME={tmp_path / 'not-cuda'} has no bin/nvcc" in str(err.value)
    assert "NCCL (nccl.h and libnccl) was not found" in str(err.value)


def test_second_build_is_a_cache_hit():
    # Its own process group: if it compiles after all, the timeout ends the whole build, not just hvdp.
    proc = subprocess.Popen([sys.executable, "-m", "hvdp.cli", "build"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("hvdp build did not hit the cache within 120 s (it compiled: was setup run after the change?)")
    assert proc.returncode == 0, stderr
    assert "Cache hit" in stdout and "Compiling" not in stdout

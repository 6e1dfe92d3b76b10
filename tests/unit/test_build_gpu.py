"""hvdp build --gpu without a GPU or the CUDA downloads: the toolkit folder made from PyPI's
wheel layouts, where the toolkit is looked for, the GPU-only patches on the real sdist, the
cache key, and what hvdp doctor says about GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdp import doctor
from hvdp.errors import BuildError
from hvdp.horovod_build import build
from hvdp.horovod_build import cuda as cuda_build

REPO = Path(__file__).resolve().parents[2]


def _file(path: Path, text: str = "", mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def fake_cu13(site: Path) -> Path:
    """site-packages/nvidia as CUDA 13's wheels lay it out: one folder, cu13, libraries in lib/."""
    root = site / "nvidia" / "cu13"
    _file(root / "bin" / "nvcc", "#!/bin/sh\nexit 1\n", 0o755)
    _file(root / "bin" / "nvcc.profile", "TOP = $(_HERE_)/..\n")
    _file(root / "nvvm" / "bin" / "cicc", "", 0o755)
    _file(root / "include" / "cuda_runtime.h", "// runtime\n")
    _file(root / "include" / "cccl" / "cuda" / "std" / "version", "// cccl\n")
    _file(root / "lib" / "libcudart.so.13", "\x7fELF cudart")
    _file(root / "lib" / "libcudart_static.a", "!<arch>")
    _file(root / "lib" / "libnvrtc.so.13", "\x7fELF nvrtc")
    _file(site / "nvidia" / "nccl" / "include" / "nccl.h", "#define NCCL_MAJOR 2\n")
    _file(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2", "\x7fELF nccl")
    return site / "nvidia"


def test_cu13_wheels_become_a_toolkit_folder_of_links(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path / "cache"))
    nvidia = fake_cu13(tmp_path / "site")
    home = Path(cuda_build.pip_cuda_home(nvidia) or "")
    assert home.parent == tmp_path / "cache" / "cuda" and home.name.startswith("cu13-")
    cu13 = nvidia / "cu13"
    assert (home / "bin" / "nvcc").resolve() == (cu13 / "bin" / "nvcc").resolve()
    assert (home / "nvvm" / "bin" / "cicc").resolve() == (cu13 / "nvvm" / "bin" / "cicc").resolve()
    assert (home / "include" / "cccl" / "cuda" / "std" / "version").read_text() == "// cccl\n"
    # Libraries in lib64 (where CMake and torch look), each versioned one also under its plain name.
    assert (home / "lib64" / "libcudart.so").resolve() == (cu13 / "lib" / "libcudart.so.13").resolve()
    assert (home / "lib64" / "libnvrtc.so").read_text() == "\x7fELF nvrtc"
    assert (home / "lib64" / "libcudart_static.a").is_symlink()
    assert (home / "lib" / "libcudart.so").resolve() == (cu13 / "lib" / "libcudart.so.13").resolve()
    # Made again from scratch: a library gone from the wheels is gone from the folder.
    (cu13 / "lib" / "libnvrtc.so.13").unlink()
    assert cuda_build.pip_cuda_home(nvidia) == str(home)
    assert not (home / "lib64" / "libnvrtc.so").exists() and not (home / "lib64" / "libnvrtc.so").is_symlink()


def test_cuda12_wheels_split_over_folders_are_merged(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path / "cache"))
    nvidia = tmp_path / "site" / "nvidia"
    _file(nvidia / "cuda_nvcc" / "bin" / "nvcc", "", 0o755)
    _file(nvidia / "cuda_nvcc" / "include" / "crt" / "host_config.h", "")
    _file(nvidia / "cuda_runtime" / "include" / "cuda_runtime.h", "")
    _file(nvidia / "cuda_runtime" / "lib" / "libcudart.so.12", "")
    _file(nvidia / "cublas" / "lib" / "libcublas.so.12", "")  # not a toolkit part: left out
    roots = cuda_build.pip_cuda_roots(nvidia)
    assert roots == [nvidia / "cuda_nvcc", nvidia / "cuda_runtime"]
    home = Path(cuda_build.pip_cuda_home(nvidia) or "")
    assert (home / "bin" / "nvcc").is_symlink()
    assert (home / "include" / "crt" / "host_config.h").exists() and (home / "include" / "cuda_runtime.h").exists()
    assert (home / "lib64" / "libcudart.so").resolve() == nvidia / "cuda_runtime" / "lib" / "libcudart.so.12"
    assert not (home / "lib64" / "libcublas.so").exists()


def test_no_nvcc_wheel_no_toolkit(tmp_path):
    nvidia = tmp_path / "nvidia"
    _file(nvidia / "cu13" / "lib" / "libcudart.so.13", "")  # the runtime that torch needs, without nvcc
    _file(nvidia / "nccl" / "include" / "nccl.h", "")
    assert cuda_build.pip_cuda_roots(nvidia) == [] and cuda_build.pip_cuda_home(nvidia) is None
    assert cuda_build.pip_cuda_roots(tmp_path / "absent") == []


def test_where_the_toolkit_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path / "cache"))
    site = tmp_path / "site"
    fake_cu13(site)
    monkeypatch.syspath_prepend(str(site))  # this environment now has the pip nvcc (nvidia/ importable)
    system = tmp_path / "cuda-13.0"
    _file(system / "bin" / "nvcc", "", 0o755)
    # 1. CUDA_HOME wins; 2. an installed toolkit's nvcc on PATH; 3. nvcc on PATH inside the wheels
    # (nvidia/cu13/bin) gives the assembled folder, as does 4. no nvcc on PATH at all.
    assert cuda_build.find_cuda_home({"CUDA_HOME": "/opt/cuda", "PATH": str(system / "bin")}) == "/opt/cuda"
    assert cuda_build.find_cuda_home({"PATH": f"{system / 'bin'}:/usr/bin"}) == str(system)
    assembled = cuda_build.find_cuda_home({"PATH": str(site / "nvidia" / "cu13" / "bin")})
    assert assembled is not None and Path(assembled).parent == tmp_path / "cache" / "cuda"
    assert cuda_build.find_cuda_home({"PATH": str(tmp_path / "empty")}) == assembled
    # And the whole GPU toolkit environment: the assembled CUDA_HOME and the pip NCCL's folder of links.
    gpu = cuda_build.toolkit_environment({"PATH": str(tmp_path / "empty")})
    assert gpu["HOROVOD_CUDA_HOME"] == assembled
    assert (Path(gpu["HOROVOD_NCCL_HOME"]) / "lib" / "libnccl.so").resolve() == (
        site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").resolve()
    options = build.BuildOptions(frameworks=["torch"], gpu=True, mpi=False, jobs=4)
    env = build.build_environment(options, {"torch": "2.13.0+cu130"}, {"PATH": "/usr/bin"}, gpu)
    assert env["CUDA_HOME"] == assembled  # torch.utils.cpp_extension's CUDA check reads it


@pytest.fixture(scope="module")
def sdist_source(unpack_sdist):
    """The real Horovod sdist, unpacked."""
    return unpack_sdist("gpu-src")


def test_gpu_patches_apply_once_to_the_real_source_after_the_common_ones(sdist_source):
    assert build.GPU_PATCHES and not set(build.GPU_PATCHES) & set(build.PATCHES)
    build.patch_source(sdist_source)
    changes = build.patch_source(sdist_source, build.GPU_PATCHES)
    assert len(changes) == len(build.GPU_PATCHES)
    for patch in build.GPU_PATCHES:
        assert patch.new in (sdist_source / patch.path).read_text(), patch.path
    with pytest.raises(BuildError, match="found it 0 times"):
        build.patch_source(sdist_source, build.GPU_PATCHES)


def test_gpu_patches_enter_the_cache_key_of_gpu_builds_only(monkeypatch):
    frameworks = {"torch": "2.13.0+cu130"}
    cpu = build.build_inputs(build.BuildOptions(), frameworks)
    gpu = build.build_inputs(build.BuildOptions(gpu=True), frameworks)
    assert "gpu_patches" not in cpu
    assert gpu["gpu_patches"] == build.patches_digest(build.GPU_PATCHES)
    changed = build.GPU_PATCHES[:-1]
    monkeypatch.setattr(build, "GPU_PATCHES", changed)
    assert build.build_inputs(build.BuildOptions(), frameworks) == cpu  # CPU key unchanged
    assert build.cache_key(build.build_inputs(build.BuildOptions(gpu=True), frameworks)) != build.cache_key(gpu)


def test_the_gpu_architectures_enter_the_cache_key_of_gpu_builds_only(monkeypatch):
    frameworks = {"torch": "2.13.0+cu130"}
    monkeypatch.delenv("HOROVOD_BUILD_CUDA_CC_LIST", raising=False)
    every = build.cache_key(build.build_inputs(build.BuildOptions(gpu=True), frameworks))
    cpu = build.cache_key(build.build_inputs(build.BuildOptions(), frameworks))
    monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", "90")
    hopper = build.cache_key(build.build_inputs(build.BuildOptions(gpu=True), frameworks))
    monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", "80")
    ampere = build.cache_key(build.build_inputs(build.BuildOptions(gpu=True), frameworks))
    assert len({every, hopper, ampere}) == 3  # a wheel for sm_90 is not reused for sm_80, nor for all
    assert build.cache_key(build.build_inputs(build.BuildOptions(), frameworks)) == cpu  # CPU keys unchanged


def test_doctor_says_plainly_that_no_gpu_is_visible():
    facts = {"gloo": True, "mpi": False, "nccl": 22907, "cuda": True, "gpus": 0}
    report = doctor.Report(versions={"horovod": "0.28.1"}, built={"torch": facts}, usable=["torch"],
                           controllers=["gloo"])
    text = doctor.render(report)
    assert "torch       available; controllers/tensor operations: Gloo, NCCL 2.29.7; CUDA: yes" in text
    assert ("GPUs: none visible to torch. NCCL 2.29.7 is built in but reduces only GPU tensors: jobs here "
            "run on the CPU (Gloo/MPI).") in text
    assert text.endswith("OK: Horovod can run a job.")  # no GPU is not a problem: CPU jobs still run
    report.built["torch"] = {**facts, "gpus": 8}
    assert "GPUs: 8 visible to torch; NCCL 2.29.7 reduces tensors on them." in doctor.render(report)
    report.built["torch"] = {"gloo": True, "mpi": True, "nccl": 0, "cuda": False}
    assert "GPUs" not in doctor.render(report)  # a CPU build says nothing about GPUs
    assert doctor.nccl_version(2804) == "2.8.4" and doctor.nccl_version(21903) == "2.19.3"

"""docker/gpu/Dockerfile for real, with podman, on a machine without a GPU: the image built by
scripts/podman-build-gpu.sh (CUDA from PyPI's wheels on the local Debian base, torch only) runs
`hvdp doctor` green with NCCL built in and says that no GPU is visible; Horovod's torch library
links libnccl; torch is PyPI's CUDA 13.0 build; no Horovod wheel is left in the image.

Opt-in (HVDP_GPU_IMAGE_TESTS=1), and not part of `make test` as the CPU image's tests are: a cold
build downloads about 3 GB of CUDA wheels and takes 4 minutes with a Horovod wheel of the image's
cache key in ~/.cache/hvdp/wheels (scripts/gpu-build-check.sh builds one), 8 without (Horovod is
compiled with NCCL in the build); seconds with podman's layers cached. HVDP_TEST_GPU_IMAGE names
the tag (default hvdp:gpu).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import images as pm
import pytest

pytestmark = [pytest.mark.timeout(3600)]

if os.environ.get("HVDP_GPU_IMAGE_TESTS") != "1":
    pytest.skip("the GPU image tests are opt-in: HVDP_GPU_IMAGE_TESTS=1 (a cold build downloads about 3 GB)",
                allow_module_level=True)
if pm.skip_reason():
    pytest.skip(pm.skip_reason(), allow_module_level=True)
if pm.podman("image", "exists", "localhost/hvdp-base:bookworm-python3.11-dev", check=False).returncode != 0:
    pytest.skip("no base image: run scripts/podman-build.sh first (it makes the Debian base)",
                allow_module_level=True)

TAG = os.environ.get("HVDP_TEST_GPU_IMAGE", "hvdp:gpu")


def build_image(tag: str, log: Path, timeout: float = 3600) -> pm.Built:
    """scripts/podman-build-gpu.sh TAG (nice 10, as the CPU image's build)."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(["nice", "-n", "10", str(pm.REPO / "scripts" / "podman-build-gpu.sh"), tag],
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    text = log.read_text()
    if done.returncode != 0:
        raise RuntimeError(f"scripts/podman-build-gpu.sh {tag} exited {done.returncode}:\n{text[-4000:]}")
    return pm.Built(tag, time.monotonic() - started, text)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> pm.Built:
    log = tmp_path_factory.mktemp("gpu-image") / "build.log"
    built = build_image(TAG, log)
    compiled = "Compiling with" in built.log
    print(f"\n[image] {TAG} built in {built.seconds:.0f} s ({pm.image_config(TAG)['Size'] / 1e9:.2f} GB), "
          f"Horovod {'compiled' if compiled else 'from the cache or the layer cache'}")
    return built


def run_in(*command: str, timeout: float = 300):
    return pm.podman("run", "--rm", "--network", "none", TAG, *command, timeout=timeout, check=False)


def test_doctor_is_green_with_nccl_and_says_no_gpu_is_visible(image):
    out = run_in("hvdp", "doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"torch +available; controllers/tensor operations: Gloo, MPI, NCCL 2\.\d+\.\d+; CUDA: yes",
                     out.stdout), out.stdout
    assert "GPUs: none visible to torch." in out.stdout and "OK: Horovod can run a job." in out.stdout


def test_horovod_torch_library_links_nccl(image):
    out = run_in("bash", "-c", "readelf -d /opt/venv/lib/python3.*/site-packages/horovod/torch/mpi_lib_v2*.so")
    assert out.returncode == 0, out.stderr
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out.stdout)
    assert "libnccl.so.2" in needed and any(n.startswith("libcudart.so.") for n in needed), needed


def test_torch_is_the_cuda_build_and_tensorflow_is_absent(image):
    out = run_in("python", "-c", "import importlib.util, torch; "
                 "print(torch.version.cuda, importlib.util.find_spec('tensorflow') is None)")
    assert out.returncode == 0, out.stderr
    cuda, no_tensorflow = out.stdout.split()
    assert cuda.startswith("13.") and no_tensorflow == "True"


def test_no_horovod_wheel_is_left_in_the_image(image):
    out = run_in("bash", "-c", "find / -xdev -name 'horovod-*.whl' 2>/dev/null; ls /var/cache/hvdp")
    assert ".whl" not in out.stdout, out.stdout

"""docker/gpu/Dockerfile's two ways to CUDA, checked without an engine or a GPU (fast, default suite).

- Its defaults still build the image `docker build -f docker/gpu/Dockerfile .` builds: the
  nvidia/cuda base, its toolkit and NCCL, torch and TensorFlow (test_static.py checks the versions).
- scripts/podman-build-gpu.sh selects the wheels path with build arguments the Dockerfile has, on
  the base scripts/podman-build.sh makes.
- The wheels path installs the CUDA wheels scripts/gpu-build-check.sh installs, at the same
  versions, and builds for the same frameworks and architectures: a Horovod wheel that script
  caches has the cache key the image's build looks for, so the image installs it instead of
  compiling it (4-8 minutes here).
- The doctor step's shell, run with stand-ins for hvdp: it passes only when doctor is green and
  reports NCCL, and needs no GPU.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "gpu" / "Dockerfile"
PODMAN_GPU = REPO / "scripts" / "podman-build-gpu.sh"
PODMAN_CPU = REPO / "scripts" / "podman-build.sh"
GPU_CHECK = REPO / "scripts" / "gpu-build-check.sh"


def dockerfile_args() -> dict:
    """ARG NAME=default of every stage (the first default of a name wins)."""
    found: dict = {}
    for name, value in re.findall(r"^ARG (\w+)(?:=(\S*))?", DOCKERFILE.read_text(), flags=re.M):
        found.setdefault(name, value)
    return found


def shell_words(path: Path) -> list:
    """The words of a shell script, continuation lines joined and comments dropped."""
    return shlex.split(path.read_text().replace("\\\n", " "), comments=True)


def script_build_args() -> dict:
    words = shell_words(PODMAN_GPU)
    return dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "--build-arg")


def wheels_branch() -> str:
    """The wheels path of the frameworks step: the text between its `then` and `else`."""
    text = DOCKERFILE.read_text()
    match = re.search(r'if \[ "\$\{CUDA_FROM\}" = wheels \]; then(.*?)\belse\b(.*?)\bfi\b', text, flags=re.S)
    assert match, "the frameworks step has no wheels branch"
    return match.group(1)


def test_defaults_are_the_nvidia_cuda_image_with_both_frameworks():
    args = dockerfile_args()
    assert args["CUDA_FROM"] == "base" and args["BASE_IMAGE"].startswith("nvidia/cuda:")
    text = DOCKERFILE.read_text()
    base = text.split('if [ "${CUDA_FROM}" = wheels ]; then', 1)[1].split("else", 1)[1].split("fi", 1)[0]
    assert '"tensorflow[and-cuda]==${TENSORFLOW_VERSION}"' in base and '--index-url "${TORCH_INDEX_URL}"' in base
    assert "libnccl-dev" in text and 'if [ "${CUDA_FROM}" = base ]' in text


def test_wheels_path_is_torch_only_from_cuda_wheels():
    branch = wheels_branch()
    assert "tensorflow" not in branch and "--index-url" not in branch
    assert '"torch==${TORCH_VERSION}"' in branch and "torch.version.cuda" in branch


def test_cuda_from_accepts_only_base_and_wheels():
    step = re.search(r'RUN (case "\$\{CUDA_FROM\}" in.*?esac)', DOCKERFILE.read_text(), flags=re.S)
    assert step
    for value, status in (("base", 0), ("wheels", 0), ("pip", 1), ("", 1)):
        out = subprocess.run(["bash", "-c", step.group(1).replace("\\\n", "\n")], env={"CUDA_FROM": value},
                             capture_output=True, text=True, check=False)
        assert out.returncode == status, (value, out.stderr)
    assert "expected base or wheels" in out.stderr


def test_podman_script_passes_only_arguments_the_dockerfile_has():
    passed, args = script_build_args(), dockerfile_args()
    assert passed["CUDA_FROM"] == "wheels"
    unknown = sorted(set(passed) - set(args))
    assert not unknown, f"scripts/podman-build-gpu.sh passes build args docker/gpu/Dockerfile lacks: {unknown}"
    assert "-f docker/gpu/Dockerfile" in " ".join(shell_words(PODMAN_GPU))


def test_podman_script_uses_the_base_the_cpu_script_makes():
    base = re.compile(r"^base=(\S+)$", flags=re.M)
    made = base.search(PODMAN_CPU.read_text())
    used = base.search(PODMAN_GPU.read_text())
    assert made and used and made.group(1) == used.group(1)
    assert script_build_args()["BASE_IMAGE"] == "${base}"


def test_wheels_path_installs_what_gpu_build_check_installs():
    """Same torch, same CUDA series, same CUDA packages: the cache key (torch's version, Python,
    MPI, g++, patches) then matches, and so does what the wheel was compiled against."""
    check = GPU_CHECK.read_text()
    torch_version = re.search(r"torch_version=\$\{HVDP_GPU_TORCH:-([\w.]+)\}", check)
    cuda_series = re.search(r"cuda_series=\$\{HVDP_GPU_CUDA:-([\w.]+)\}", check)
    assert torch_version and cuda_series
    args = dockerfile_args()
    assert args["TORCH_VERSION"] == torch_version.group(1)
    assert args["CUDA_WHEELS"] == cuda_series.group(1)
    install = check.split("pypi_pip install -q", 1)[1].split("\nlog ", 1)[0]
    checked = set(re.findall(r"nvidia-[a-z0-9-]*[a-z0-9]", install))
    branch = wheels_branch()
    imaged = set(re.findall(r"nvidia-[a-z0-9-]*[a-z0-9]", branch.replace("${CUDA_WHEELS%%.*}", "13")))
    assert checked and checked == imaged, (checked, imaged)


def test_same_frameworks_and_architectures_as_gpu_build_check():
    """gpu-build-check builds --frameworks torch for every architecture nvcc knows; the image builds
    for every framework installed (torch alone on the wheels path) with CUDA_CC_LIST, which the
    podman script leaves empty (the cache key does not include the architectures)."""
    check = GPU_CHECK.read_text()
    assert "--gpu --frameworks torch" in check and "HOROVOD_BUILD_CUDA_CC_LIST" not in check
    assert script_build_args()["CUDA_CC_LIST"] == ""
    text = DOCKERFILE.read_text()
    assert 'if [ -n "${CUDA_CC_LIST}" ]; then export HOROVOD_BUILD_CUDA_CC_LIST=' in text
    assert "BuildOptions(gpu=True, jobs=${BUILD_JOBS})" in text  # frameworks: those installed


def doctor_step() -> str:
    """The shell of the RUN instruction that runs hvdp doctor."""
    steps = [s for s in DOCKERFILE.read_text().split("\nRUN ")[1:] if "hvdp doctor >" in s]
    assert len(steps) == 1, "no single doctor step"
    return steps[0].split("\n\n", 1)[0].replace("\\\n", "\n")


@pytest.mark.parametrize("report, status, passes", [
    ("torch       available; controllers/tensor operations: Gloo, MPI, NCCL 2.29.7; CUDA: yes", 0, True),
    ("torch       available; controllers/tensor operations: Gloo, MPI; CUDA: no", 0, False),
    ("torch       available; controllers/tensor operations: Gloo, MPI, NCCL 2.29.7; CUDA: yes", 1, False),
], ids=["nccl", "no-nccl", "doctor-fails"])
def test_doctor_step_passes_only_with_nccl_and_a_green_doctor(tmp_path, report, status, passes):
    """The step's shell, run with stand-ins for hvdp and ldconfig."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("hvdp", f"printf '%s\\n' 'Horovod built with:' '  {report}'; exit {status}"),
                       ("ldconfig", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = doctor_step().replace("/tmp/doctor.txt", str(tmp_path / "doctor.txt"))
    out = subprocess.run(["bash", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                         capture_output=True, text=True, check=False)
    assert (out.returncode == 0) is passes, out.stdout + out.stderr
    assert report in out.stdout  # the report is shown either way
    if status == 0 and not passes:
        assert "built without NCCL" in out.stderr

#!/usr/bin/env bash
# Compile hvdp's GPU build of Horovod on a machine without a GPU: proves that `hvdp build --gpu`
# builds Horovod 0.28.1 with NCCL against PyPI's CUDA build of torch, and that `hvdp doctor`
# then reports NCCL built in and says that no GPU is visible.
#
# It makes a separate virtual environment outside the repository (reused when present) and
# installs into it, from PyPI, the CUDA build of torch 2.13.0 (CUDA 13.0), nvcc 13.0, the CUDA
# runtime and NCCL: several GB, so this runs by hand, never in CI (.venv/ is not touched).
#
#   scripts/gpu-build-check.sh            # venv in ~/.cache/hvdp/gpu-venv (HVDP_GPU_VENV moves it)
#   scripts/gpu-build-check.sh --force    # rebuild Horovod even if the cached wheel fits
#
# Exit status 0 only when the build succeeded, the Horovod torch library links libnccl, and
# hvdp doctor reports NCCL built in. The wheel it caches in ~/.cache/hvdp/wheels has the cache key
# of the GPU image that scripts/podman-build-gpu.sh builds (same torch, CUDA wheels, Python,
# Open MPI and g++; tests/cluster/test_gpu_static.py keeps the two in step), which installs it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${HVDP_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdp/gpu-venv}
torch_version=${HVDP_GPU_TORCH:-2.13.0}
cuda_series=${HVDP_GPU_CUDA:-13.0}
build_args=(--gpu --frameworks torch --jobs "${HVDP_BUILD_JOBS:-$(nproc)}")
[ "${1:-}" = --force ] && build_args+=(--force)

log() { printf '[gpu-build-check] %s\n' "$*"; }

# pip from PyPI only: this machine's pip may be configured with local wheel directories and
# extra indexes (which hold the CPU torch); none of that applies to this environment.
pypi_pip() {
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
    PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip "$@"
}

if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
log "installing torch==$torch_version (CUDA build), nvcc, the CUDA runtime and NCCL from PyPI into $venv"
# nvcc's compiler front end (crt), nvvm and the C++ headers (cccl) pinned to nvcc's release: pip would
# otherwise take the newest ones, which a CUDA 13.0 nvcc does not match.
pypi_pip install -q "torch==$torch_version" "nvidia-cuda-nvcc==$cuda_series.*" \
  "nvidia-cuda-crt==$cuda_series.*" "nvidia-nvvm==$cuda_series.*" "nvidia-cuda-cccl==$cuda_series.*" \
  "nvidia-cuda-runtime==$cuda_series.*" nvidia-nccl-cu13
log "installing hvdp (editable, without extras: the CUDA torch stays)"
pypi_pip install -q -e "$repo"
"$venv/bin/python" - <<'EOF'
import torch
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
print(f"[gpu-build-check] torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU visible: {torch.cuda.is_available()}")
EOF

# No CUDA_HOME and no nvcc on PATH (a toolkit this machine may have elsewhere is left out), so
# hvdp build takes the nvcc and NCCL of the wheels above and assembles a toolkit folder of links.
path=$venv/bin
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
  [ -n "$dir" ] && [ ! -x "$dir/nvcc" ] && path=$path:$dir
done
start=$(date +%s)
env -u CUDA_HOME -u HOROVOD_CUDA_HOME -u HOROVOD_NCCL_HOME -u NCCL_HOME \
  PATH="$path" "$venv/bin/hvdp" build "${build_args[@]}"
log "hvdp build --gpu finished in $(($(date +%s) - start)) s (a cache hit takes seconds)"

lib=$("$venv/bin/python" -c "import glob, os, horovod.torch as h; \
print(glob.glob(os.path.join(os.path.dirname(h.__file__), 'mpi_lib_v2*.so'))[0])")
log "NEEDED libraries of $lib:"
readelf -d "$lib" | grep NEEDED
log "ldd $lib | grep -E 'nccl|cudart':"
ldd "$lib" | grep -E 'nccl|cudart' || true
readelf -d "$lib" | grep -q 'NEEDED.*libnccl' || { log "FAIL: $lib does not link libnccl"; exit 1; }

log "hvdp doctor:"
set +e
doctor=$("$venv/bin/hvdp" doctor 2>&1)
status=$?
set -e
printf '%s\n' "$doctor"
grep -q 'NCCL 2' <<<"$doctor" || { log "FAIL: hvdp doctor does not report NCCL built in"; exit 1; }
log "OK: Horovod built with NCCL (doctor exit status $status)"

#!/usr/bin/env bash
# Build docker/gpu/Dockerfile with podman on a machine that reaches package registries but no
# container registry, so no nvidia/cuda base: the Dockerfile's CUDA_FROM=wheels path, on the local
# Debian bookworm base that scripts/podman-build.sh makes, with CUDA from PyPI's wheels (torch
# 2.13.0, which is PyPI's CUDA 13.0 build; nvcc, the CUDA runtime and NCCL of CUDA 13.0), torch only.
#
#   scripts/podman-build-gpu.sh [TAG] [podman build options...]      # TAG default: hvdp:gpu
#
# 1. Needs what scripts/podman-build.sh sets up (run it once first): podman with its
#    containers.conf, and the base image localhost/hvdp-base:bookworm-python3.11-dev.
# 2. pip in the build reads PyPI only (PIP_INDEX_URL, if set, instead), with this machine's CA
#    bundle, both in a read-only build volume: a local wheel directory or index may hold a CPU build
#    of torch, which `torch==2.13.0` would take (2.13.0+cpu matches it and sorts above it).
# 3. Mounts `hvdp build`'s wheel cache (~/.cache/hvdp/wheels) where the image's build looks, so
#    a GPU wheel built here for the same cache key (scripts/gpu-build-check.sh builds one: Horovod,
#    patches, Python 3.11, torch 2.13.0, NCCL, Open MPI, g++) is installed instead of compiled
#    (about 30 minutes on 2 cores), and one compiled in the build is kept there. Like that script,
#    the image compiles Horovod's CUDA kernels for every architecture nvcc 13.0 knows
#    (CUDA_CC_LIST empty): the cache key does not include the architecture list.
#
# Elsewhere, `docker build -f docker/gpu/Dockerfile -t hvdp:gpu .` (the nvidia/cuda base, CUDA 12.8,
# torch and TensorFlow) needs none of this.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[podman-build-gpu] %s\n' "$*" >&2; }

tag=hvdp:gpu
if (($#)) && [[ $1 != -* ]]; then
  tag=$1
  shift
fi
base=localhost/hvdp-base:bookworm-python3.11-dev
state="${XDG_CACHE_HOME:-${HOME}/.cache}/hvdp/podman"
export CONTAINERS_CONF="${state}/containers.conf"
if ! command -v podman >/dev/null 2>&1 || [ ! -f "${CONTAINERS_CONF}" ] || ! podman image exists "${base}"; then
  log "podman, ${CONTAINERS_CONF} and the base image ${base} are made by scripts/podman-build.sh: run it first"
  exit 1
fi

# pip: PyPI and this machine's CA bundle, in one folder mounted read-only where pip looks for its
# site configuration (/etc/xdg/pip): the bundle is not mounted over the base's own, which a base
# without ca-certificates would install there.
pip_dir="${state}/pip-gpu"
mkdir -p "${pip_dir}"
volumes=(--volume "${pip_dir}:/etc/xdg/pip:ro")
index=${PIP_INDEX_URL:-https://pypi.org/simple}
cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
{
  echo "[global]"
  echo "index-url = ${index}"
  echo "timeout = ${PIP_DEFAULT_TIMEOUT:-180}"
  if [[ ${cert} == /* && -f ${cert} ]]; then
    cp "${cert}" "${pip_dir}/ca.crt"
    echo "cert = /etc/xdg/pip/ca.crt"
  fi
} >"${pip_dir}/pip.conf"

# Horovod wheels that `hvdp build` cached on this machine (a build volume: no wheel enters a layer).
wheels="${HVDP_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME}/.cache}/hvdp}/wheels"
mkdir -p "${wheels}"
volumes+=(--volume "${wheels}:/var/cache/hvdp/wheels")

log "building ${tag} with CUDA from PyPI's wheels (index ${index})"
started=$(date +%s)
podman build --format docker --network host "${volumes[@]}" \
  --build-arg "BASE_IMAGE=${base}" --build-arg CUDA_FROM=wheels --build-arg CUDA_CC_LIST= \
  --build-arg "BUILD_JOBS=$(nproc)" \
  -f docker/gpu/Dockerfile -t "${tag}" "$@" .
log "built ${tag} in $(($(date +%s) - started)) s ($(podman image inspect --format '{{.Size}}' "${tag}") bytes)"

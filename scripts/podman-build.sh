#!/usr/bin/env bash
# Build docker/cpu/Dockerfile with podman on a machine that reaches package registries but no
# container registry:
#
#   scripts/podman-build.sh [TAG] [podman build options...]      # TAG default: hvdp:cpu
#
# 1. Installs podman, runc and debootstrap (Debian) when missing; podman runs with runc and
#    default ulimits from a containers.conf this script writes (CONTAINERS_CONF, not /etc).
# 2. Makes the base image once: Debian bookworm (debootstrap --variant=minbase, from the
#    mirror this machine's apt uses) with python3, its headers (Horovod's build includes
#    Python.h), venv and `python` (localhost/hvdp-base).
# 3. Builds with this machine's pip configuration: the settings `pip config list` shows here
#    become the build's /etc/pip.conf, and every local path they name (wheel directories, file://
#    indexes, constraints, the CA bundle) is mounted read-only at the same place. Docker's image
#    format keeps the Dockerfile's SHELL (bash with pipefail), which OCI's drops. Build volumes
#    are not part of the image, and the repository names no host of this machine.
#
# Elsewhere, `docker build -f docker/cpu/Dockerfile -t hvdp:cpu .` needs none of this.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/apt-install.sh
source scripts/apt-install.sh  # the working directory is the repository root

log() { printf '[podman-build] %s\n' "$*" >&2; }

tag=hvdp:cpu
if (($#)) && [[ $1 != -* ]]; then
  tag=$1
  shift
fi
base=localhost/hvdp-base:bookworm-python3.11-dev
state="${XDG_CACHE_HOME:-${HOME}/.cache}/hvdp/podman"
mkdir -p "${state}"

# 1. Tools and configuration.
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
[ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || need+=(runc)
[ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
apt_install "${need[@]}"
export CONTAINERS_CONF="${state}/containers.conf"
cat >"${CONTAINERS_CONF}" <<'EOF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
EOF

# 2. The base image (its debootstrap root is kept as an image of its own, made once).
if ! podman image exists "${base}"; then
  started=$(date +%s)
  if ! podman image exists localhost/hvdp-debootstrap:bookworm; then
    mirror=$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    mirror=${mirror:-http://deb.debian.org/debian}
    root=$(mktemp -d)
    trap 'rm -rf "${root}"' EXIT
    log "making localhost/hvdp-debootstrap:bookworm with debootstrap from ${mirror}"
    debootstrap --variant=minbase bookworm "${root}" "${mirror}" >"${state}/debootstrap.log" 2>&1 \
      || { tail -20 "${state}/debootstrap.log" >&2; exit 1; }
    tar -C "${root}" -c . | podman import - localhost/hvdp-debootstrap:bookworm >/dev/null
  fi
  podman build --network host -t "${base}" -f - . <<'EOF'
FROM localhost/hvdp-debootstrap:bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-dev python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
CMD ["python"]
EOF
  log "base image made in $(($(date +%s) - started)) s"
fi

# 3. This machine's pip configuration, as a file and read-only volumes.
pip_conf="${state}/pip.conf"
volumes=()
{
  echo "[global]"
  python3 -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.\([a-z-]*\)='\(.*\)'$/\1 = \2/p" | sort -u -t= -k1,1
} >"${pip_conf}"
volumes+=(--volume "${pip_conf}:/etc/pip.conf:ro")
while read -r -a values; do
  for value in "${values[@]}"; do
    path=${value#file://}
    # A file:// index's pages link to files beside it (e.g. simple/ and files/): mount its parent.
    [[ ${value} == file://* ]] && path=$(dirname "${path%/}")
    if [[ ${path} == /* && -e ${path} ]]; then
      volumes+=(--volume "${path}:${path}:ro")
    fi
  done
done < <(sed -n 's/^[a-z-]* = //p' "${pip_conf}")
index=$(python3 -m pip config get global.index-url 2>/dev/null || echo https://pypi.org/simple)

# 4. Horovod wheels that `hvdp build` cached on this machine: the image's build reuses one whose
#    cache key (Horovod, patches, Python, frameworks, MPI, compiler) matches exactly, and a wheel
#    it compiles lands here for the next build. A build volume, so no wheel enters a layer.
wheels="${HVDP_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME}/.cache}/hvdp}/wheels"
mkdir -p "${wheels}"
volumes+=(--volume "${wheels}:/var/cache/hvdp/wheels")

log "building ${tag} (pip settings: $(grep -c ' = ' "${pip_conf}"), volumes: $((${#volumes[@]} / 2)))"
started=$(date +%s)
podman build --format docker --network host "${volumes[@]}" \
  --build-arg "BASE_IMAGE=${base}" --build-arg "TORCH_INDEX_URL=${index}" \
  -f docker/cpu/Dockerfile -t "${tag}" "$@" .
log "built ${tag} in $(($(date +%s) - started)) s"

#!/usr/bin/env bash
# hvdp on one NVIDIA GPU, in one command that fits in 10 minutes on a machine with no network:
# build Horovod with NCCL for the torch there (Gloo controller, no MPI), hvdp doctor, train
# examples/train_digits.py on the GPU (np=1), hvdp's step time against plain torch and DDP (NCCL)
# on the same GPU with the ratio hvdp / DDP, a 64 MB allreduce against torch.distributed's (NCCL)
# with the bandwidth ratios, and the equivalence checks one device allows (scripts/gpu_check.py).
# Every figure is printed; a summary of the steps comes last, and the exit status is 1 if any step
# failed.
#
# What the GPU machine must have: Python with a CUDA build of torch and numpy, nvcc (CUDA_HOME,
# on PATH, a pip nvcc wheel or /usr/local/cuda), NCCL (the pip nvidia-nccl-cu* wheel torch uses,
# or HOROVOD_NCCL_HOME), cmake and a C++ compiler. What it gets from here (build/gpu-bundle/,
# about 55 MB with the repository under the 64 MiB that may travel): Horovod's sdist and wheels
# for Python 3.12 of what hvdp, Horovod's build and the example need beyond torch and numpy.
#
#   scripts/gpu-check.sh --prepare        # here, with network: fill build/gpu-bundle/, check its size
#   scripts/gpu-check.sh                  # on the GPU machine (from the repository root)
#   scripts/gpu-check.sh --dry-run        # without a GPU: the bundle checks, then every step on the
#                                         # CPU with the Horovod already installed (no build)
# Options: --python PY (default python3), --work DIR (default ${TMPDIR:-/tmp}/hvdp-gpu-check),
# --sdist PATH (default build/gpu-bundle/horovod-0.28.1.tar.gz, else ~/.cache/hvdp/sdist/).
# The step functions below are run through step "NAME" CAP FUNCTION, which ShellCheck cannot follow.
# shellcheck disable=SC2329
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bundle=$repo/build/gpu-bundle
sdist_name=horovod-0.28.1.tar.gz
sdist_sha256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# What travels besides the repository: pinned to the versions hvdp's CPU environment tests with.
bundle_wheels=(cloudpickle==3.1.3 psutil==7.2.2 pyyaml==6.0.4 packaging==26.4 tqdm==4.70.1
  setuptools==84.2.1 wheel==0.48.0 scikit-learn==1.9.1 scipy==1.17.1 joblib==1.6.0 threadpoolctl==3.8.0)
limit_mib=64
mode=gpu
python=python3
work=${TMPDIR:-/tmp}/hvdp-gpu-check
sdist=""
while (($#)); do
  case $1 in
    --prepare) mode=prepare ;;
    --dry-run) mode=dry-run ;;
    --python) python=$2; shift ;;
    --work) work=$2; shift ;;
    --sdist) sdist=$2; shift ;;
    -h|--help) sed -n "2,22p" "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '\n[gpu-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
steps=()
failed=0
# step NAME CAP_SECONDS COMMAND...: run, time, record. A program over its cap is stopped and fails;
# the shell functions below run without a cap (they are quick, or bound their own programs).
step() {
  local name=$1 cap=$2 start status
  shift 2
  log "$name (at most $cap s)"
  start=$(date +%s%N)
  if declare -F "$1" >/dev/null; then
    "$@"
  else
    timeout --kill-after=10 "$cap" "$@"
  fi
  status=$?
  local took=$((($(date +%s%N) - start) / 100000000))  # tenths of a second
  took=$((took / 10)).$((took % 10))
  steps+=("$(printf '%-52s %-7s %7s s' "$name" "$([ "$status" = 0 ] && echo ok || echo FAIL:$status)" "$took")")
  [ "$status" = 0 ] || failed=1
  return "$status"
}
summary() {
  log "summary"
  printf '  %s\n' "${steps[@]}"
  [ "$failed" = 0 ] && echo "  all steps passed" || echo "  some steps FAILED"
  exit "$failed"
}

# pip from PyPI only (--prepare): leave out any local wheel directories or indexes this machine's
# pip is configured with.
pypi_pip() {
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
    PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$python" -m pip "$@"
}

find_sdist() {
  local candidate
  for candidate in "$sdist" "$bundle/$sdist_name" "${XDG_CACHE_HOME:-$HOME/.cache}/hvdp/sdist/$sdist_name"; do
    [ -n "$candidate" ] && [ -f "$candidate" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

# The files that travel to the GPU machine: the repository (tracked and untracked, not ignored)
# plus build/gpu-bundle. Prints sizes; fails over the limit or with a wrong sdist.
check_bundle() {
  local found repo_bytes bundle_bytes total
  found=$(find_sdist) || { echo "no $sdist_name: run scripts/gpu-check.sh --prepare (or pass --sdist)"; return 1; }
  [ "$(sha256sum "$found" | cut -d' ' -f1)" = "$sdist_sha256" ] || { echo "$found: wrong sha256"; return 1; }
  echo "sdist: $found ($(stat -c %s "$found") bytes, sha256 ok)"
  # With git: the files that travel (tracked, and untracked but not ignored); without: the whole tree.
  if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    repo_bytes=$(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
      | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  else
    repo_bytes=$(du -sb --exclude=build "$repo" | cut -f1)
  fi
  bundle_bytes=$(du -sb "$bundle" 2>/dev/null | cut -f1)
  total=$((repo_bytes + ${bundle_bytes:-0}))
  echo "repository files: $repo_bytes bytes; build/gpu-bundle: ${bundle_bytes:-0} bytes; together $total bytes" \
    "($((total / 1048576)) MiB of $limit_mib MiB)"
  find "$bundle/wheels" -name '*.whl' -printf '  %10s  %f\n' 2>/dev/null | sort -k2
  ((total <= limit_mib * 1048576)) || { echo "over $limit_mib MiB"; return 1; }
  # Every wheel hvdp needs resolves offline for CPython 3.12 on x86-64 Linux (torch and numpy are
  # the machine's own).
  pypi_pip install --dry-run -q --no-index --find-links "$bundle/wheels" --python-version 3.12 \
    --implementation cp --only-binary=:all: --target "$work/offline-check" --no-deps "${bundle_wheels[@]}" \
    && echo "the wheels resolve offline for CPython 3.12"
}

if [ "$mode" = prepare ]; then
  mkdir -p "$bundle/wheels"
  found=$(find_sdist) || {
    pypi_pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$bundle" && found=$bundle/$sdist_name; }
  [ "$found" = "$bundle/$sdist_name" ] || cp "$found" "$bundle/$sdist_name"
  pypi_pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$bundle/wheels" "${bundle_wheels[@]}" || exit 1
  check_bundle
  exit
fi

device=cuda
[ "$mode" = dry-run ] && device=cpu
mkdir -p "$work"
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# No network there: pip uses only the bundle's wheels (and what is installed).
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$bundle/wheels PIP_DISABLE_PIP_VERSION_CHECK=1

step "files brought along" 60 check_bundle

machine() {
  echo "host: $(uname -srm), $(nproc) cores; python: $("$python" -V 2>&1) ($python)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" - <<'EOF'
import importlib.metadata as md
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}")
for dist in ("numpy", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-cuda-nvcc", "mpi4py", "horovod"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -2
  cmake --version | head -1; command -v ninja >/dev/null && echo "ninja $(ninja --version)"
  # Horovod's torch extension loads the driver as libcuda.so.1 (hvdp's GPU patch); plain 0.28.1
  # asked for libcuda.so, which driver-only machines may lack.
  ldconfig -p | grep -E 'libcuda\.so' || echo "no libcuda in the loader cache"
}
step "the machine" 60 machine || [ "$mode" = dry-run ] || summary

if [ "$mode" = gpu ]; then
  # A virtual environment over the machine's packages, so that nothing is installed into them.
  venv=$work/venv
  log "virtual environment over the machine's packages: $venv"
  if { "$python" -m venv --system-site-packages "$venv" 2>/dev/null \
       || "$python" -m venv --system-site-packages --without-pip "$venv"; } && "$venv/bin/python" -m pip --version; then
    python=$venv/bin/python
    export PATH=$venv/bin:$PATH
  else  # no venv module, or no pip the venv can use: install into the machine's Python itself
    echo "no usable virtual environment: installing into $python's own site-packages"
    export PIP_BREAK_SYSTEM_PACKAGES=1
  fi
  step "wheels from build/gpu-bundle (offline)" 120 "$python" -m pip install -q --no-index \
    --find-links "$bundle/wheels" "${bundle_wheels[@]}" || summary
  export HVDP_CACHE_DIR=$work/cache
  mkdir -p "$HVDP_CACHE_DIR/sdist"
  cp "$(find_sdist)" "$HVDP_CACHE_DIR/sdist/$sdist_name"
  # Kernels for this GPU's architecture only (a faster build); HOROVOD_BUILD_CUDA_CC_LIST overrides.
  cc=$("$python" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))" 2>/dev/null) || cc=""
  export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$cc}
  echo "HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-<every architecture nvcc knows>}"
  step "hvdp build --gpu (NCCL, Gloo, no MPI)" 300 "$python" -m hvdp.cli build --gpu --frameworks torch \
    --no-mpi --jobs "$(nproc)" || { tail -60 "$HVDP_CACHE_DIR"/logs/build-*.log; summary; }
  linked() {
    local lib
    lib=$("$python" -c "import glob, os, horovod.torch as h; \
print(glob.glob(os.path.join(os.path.dirname(h.__file__), 'mpi_lib_v2*.so'))[0])") || return 1
    readelf -d "$lib" | grep NEEDED
    ldd "$lib" | grep -E 'nccl|cudart'
    readelf -d "$lib" | grep -q 'NEEDED.*libnccl'
  }
  step "Horovod's torch library links libnccl" 30 linked
else
  echo "dry run: no GPU build here (it needs the GPU machine's torch); using the Horovod of $python"
fi

hvdp() { "$python" -m hvdp.cli "$@"; }
doctor() {
  local out
  out=$(hvdp doctor 2>&1); local status=$?
  printf '%s\n' "$out"
  [ "$mode" = dry-run ] && return "$status"
  grep -q 'NCCL 2' <<<"$out" && grep -q 'GPUs: [1-9]' <<<"$out" && return "$status"
  echo "hvdp doctor does not report NCCL and a visible GPU"; return 1
}
step "hvdp doctor" 60 doctor

if [ "$mode" = gpu ]; then
  step "train_digits.py on the GPU, np=1 (20 epochs)" 90 "$python" -m hvdp.cli run -np 1 --framework torch \
    examples/train_digits.py --epochs 20
else
  step "train_digits.py on the CPU, np=1 (2 epochs)" 300 "$python" -m hvdp.cli run -np 1 --framework torch \
    examples/train_digits.py --epochs 2
fi

timing=(--steps 100 --rounds 5)
cap=120
[ "$mode" = dry-run ] && timing=(--steps 3 --rounds 2) && cap=400  # the CPU: a few steps, to run the code
step "step time, hvdp's defaults (HOROVOD_CYCLE_TIME=5)" "$cap" "$python" -m hvdp.cli run -np 1 \
  --framework torch scripts/gpu_check.py steptime --device "$device" "${timing[@]}" --json "$work/steptime.json"
step "step time, HOROVOD_CYCLE_TIME=1 (Horovod's default)" "$cap" env HOROVOD_CYCLE_TIME=1 \
  "$python" -m hvdp.cli run -np 1 --framework torch scripts/gpu_check.py steptime --device "$device" \
  "${timing[@]}" --json "$work/steptime-cycle1.json"
rm -f "$work/timeline.json"
[ "$mode" = dry-run ] && cap=900 || cap=240
step "equivalence on one device (and the NCCL timeline)" "$cap" env HOROVOD_TIMELINE="$work/timeline.json" \
  "$python" -m hvdp.cli run -np 1 --framework torch scripts/gpu_check.py equivalence --device "$device" \
  --json "$work/equivalence.json"
echo "figures as JSON: $work/steptime.json $work/steptime-cycle1.json $work/equivalence.json"
summary

#!/usr/bin/env bash
# Set up a fresh machine for hvdp: Debian packages, .venv/, Python packages, Horovod.
# Idempotent: a second run checks each step and skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/apt-install.sh
source scripts/apt-install.sh  # the working directory is the repository root

log() { printf '[setup] %s\n' "$*"; }

# 1. Debian packages: Open MPI (runtime and headers), cmake, a C++ compiler; for the multi-host
#    and Slurm tests (tests/cluster/), sshd and ssh, ip for network namespaces, Slurm and munge;
#    tmux for the test that reads what a terminal shows (tests/parallel/test_output.py).
need=()
{ command -v mpirun && command -v mpicxx; } >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
{ [ -x /usr/sbin/sshd ] && command -v ssh && command -v ssh-keygen; } >/dev/null 2>&1 || need+=(openssh-server openssh-client)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch; } >/dev/null 2>&1 || need+=(slurm-wlm)
{ [ -x /usr/sbin/munged ] && [ -x /usr/sbin/mungekey ]; } >/dev/null 2>&1 || need+=(munge)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
apt_install "${need[@]}"

# 2. The virtual environment, at .venv/ in the repository root.
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi

# 3. Python packages (skipped when setup.py has not changed since the last install).
stamp=.venv/.hvdp-setup-stamp
want=$(sha256sum setup.py scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  log "installing torch 2.13.0 (CPU), tensorflow-cpu 2.21.0, mpi4py, Ray 2.60.0, test tools and linters into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[torch,tensorflow,mpi,report,dev,ray]'
  echo "$want" >"$stamp"
else
  log "Python packages up to date"
fi

# 4. Horovod, built for the installed frameworks (a cached wheel is reused).
.venv/bin/hvdp build

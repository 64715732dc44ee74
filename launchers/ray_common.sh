# Shared by ray_on_slurm.sh (inlined into the job script by `nemo-rl launch slurm`) and
# ray_local.sh (sourced): the Ray port layout, `ray start` arguments, the environment Ray
# processes get, bounded waits and process stopping. Settings are NRL_* variables, documented in
# launchers/README.md. Needs bash >= 4.4.

# Exit codes of the launchers; nemo_rl/launch/exit_codes.py holds the same numbers.
NRL_EXIT_USAGE=2       # bad settings or command line
NRL_EXIT_HEAD=3        # the Ray head did not start or answer in time
NRL_EXIT_NODES=4       # not every Ray node registered with the head in time
NRL_EXIT_NODE_DIED=5   # a Ray node ended while the job was running

# Port layout of one Ray cluster, every listener pinned (Ray's own helper processes add only
# kernel-assigned ephemeral ports). B = NRL_RAY_PORT_BASE, W = NRL_RAY_WORKER_PORTS:
#   B    GCS (head)      B+1  Ray client server (head)      B+2  dashboard (head, when enabled)
# Node block k (the k-th Ray node on one IP address; always 0 when every node has its own
# address) starts at P = B + 8 + k * (8 + W):
#   P    node manager    P+1  object manager    P+2  metrics export    P+3  dashboard agent gRPC
#   P+4  dashboard agent HTTP    P+5  runtime-env agent    P+8 .. P+7+W  Ray worker processes
NRL_PORT_BLOCK_HEADER=8

nrl_log() { printf '[nemo-rl launch %(%H:%M:%S)T] %s\n' -1 "$*"; }

# nrl_fail CODE MESSAGE...: print the error and exit with CODE (the EXIT trap tears down).
nrl_fail() {
  local code=$1
  shift
  printf '[nemo-rl launch %(%H:%M:%S)T] error: %s\n' -1 "$*" >&2
  exit "$code"
}

# nrl_port_span NODES_PER_ADDRESS: ports the layout needs when at most NODES_PER_ADDRESS Ray
# nodes share one IP address.
nrl_port_span() {
  echo $((NRL_PORT_BLOCK_HEADER + $1 * (NRL_PORT_BLOCK_HEADER + NRL_RAY_WORKER_PORTS)))
}

# nrl_first_ephemeral_port: the start of this machine's ephemeral port range (kernel-assigned
# ports, which pinned ports must stay below).
nrl_first_ephemeral_port() {
  local first=32768 _last
  read -r first _last </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null
  echo "$first"
}

# nrl_check_ports SPAN: fail unless [NRL_RAY_PORT_BASE, +SPAN) lies in 1024 .. the ephemeral range.
nrl_check_ports() {
  local span=$1 first_ephemeral
  first_ephemeral=$(nrl_first_ephemeral_port)
  if ((NRL_RAY_PORT_BASE < 1024 || NRL_RAY_PORT_BASE + span > first_ephemeral)); then
    nrl_fail "$NRL_EXIT_USAGE" "Ray ports $NRL_RAY_PORT_BASE-$((NRL_RAY_PORT_BASE + span - 1))" \
      "must lie within 1024-$((first_ephemeral - 1)) (the ephemeral range starts at" \
      "$first_ephemeral); lower --ray-port-base (NRL_RAY_PORT_BASE) or --ray-worker-ports" \
      "(NRL_RAY_WORKER_PORTS)"
  fi
}

# nrl_default_port_base SPAN KEY: a port base in [20000, ephemeral range) picked by KEY (the job
# id), so that jobs sharing a node most likely get disjoint ranges.
nrl_default_port_base() {
  local span=$1 key=$2 slots
  slots=$((($(nrl_first_ephemeral_port) - 20000) / span))
  if ((slots < 1)); then
    nrl_fail "$NRL_EXIT_USAGE" "the Ray port layout needs $span ports, more than fit between" \
      "20000 and the ephemeral range; lower --ray-worker-ports (NRL_RAY_WORKER_PORTS)"
  fi
  echo $((20000 + (key % slots) * span))
}

# nrl_ray_start_args ROLE ADDRESS BLOCK [HEAD_ADDRESS]: fill the array NRL_RAY_ARGS with the
# `ray start --block` arguments of a head (ROLE=head) or worker node advertising ADDRESS, using
# port block BLOCK; workers join the GCS at HEAD_ADDRESS:NRL_RAY_PORT_BASE.
nrl_ray_start_args() {
  local role=$1 address=$2 block=$3 head_address=${4:-}
  local base=$NRL_RAY_PORT_BASE
  local p=$((base + NRL_PORT_BLOCK_HEADER + block * (NRL_PORT_BLOCK_HEADER + NRL_RAY_WORKER_PORTS)))
  NRL_RAY_ARGS=(start --block --disable-usage-stats --node-ip-address="$address"
    --node-manager-port="$p" --object-manager-port="$((p + 1))"
    --metrics-export-port="$((p + 2))" --dashboard-agent-grpc-port="$((p + 3))"
    --dashboard-agent-listen-port="$((p + 4))" --runtime-env-agent-port="$((p + 5))"
    --min-worker-port="$((p + 8))" --max-worker-port="$((p + 7 + NRL_RAY_WORKER_PORTS))")
  [[ -n ${NRL_RAY_NUM_CPUS:-} ]] && NRL_RAY_ARGS+=(--num-cpus="$NRL_RAY_NUM_CPUS")
  [[ -n ${NRL_GPUS_PER_NODE:-} ]] && NRL_RAY_ARGS+=(--num-gpus="$NRL_GPUS_PER_NODE")
  [[ -n ${NRL_RAY_TEMP_DIR:-} ]] && NRL_RAY_ARGS+=(--temp-dir="$NRL_RAY_TEMP_DIR")
  if [[ $role == head ]]; then
    NRL_RAY_ARGS+=(--head --port="$base" --ray-client-server-port="$((base + 1))")
    if [[ ${NRL_RAY_DASHBOARD:-0} == 1 ]]; then
      NRL_RAY_ARGS+=(--include-dashboard=true --dashboard-host="$address"
        --dashboard-port="$((base + 2))")
    else
      NRL_RAY_ARGS+=(--include-dashboard=false)
    fi
  else
    NRL_RAY_ARGS+=(--address="$head_address:$base")
  fi
  # Extra `ray start` arguments, split on whitespace on purpose.
  # shellcheck disable=SC2206
  NRL_RAY_ARGS+=(${NRL_RAY_START_ARGS:-})
}

# nrl_exec_with_ray_env CMD...: exec CMD with only the environment Ray processes (and so every
# actor, which inherits it) should see: a base list (paths, locale, slurm, CUDA/NCCL, ML
# libraries, Ray) plus the names or glob patterns in NRL_ENV_PASSTHROUGH ("*" keeps everything).
# Secrets and settings meant for the driver alone (WANDB_API_KEY, ...) stay with the driver.
# Runs inside srun steps through `declare -f`, so it must be self-contained.
nrl_exec_with_ray_env() {
  local -
  set -f # the patterns are globs for [[ == ]], never for file names
  local base='PATH HOME USER LOGNAME SHELL LANG LANGUAGE LC_* TZ TMPDIR TERM HOSTNAME
    LD_LIBRARY_PATH LD_PRELOAD PYTHONPATH PYTHONUNBUFFERED PYTHONHASHSEED PYTHONNOUSERSITE
    VIRTUAL_ENV CONDA_* SLURM_* SLURMD_* CUDA_* NVIDIA_* NCCL_* NVTE_* UCX_* FI_* TORCH_*
    TORCHINDUCTOR_* TRITON_* OMP_NUM_THREADS HF_* HUGGING_FACE_* TRANSFORMERS_* VLLM_* RAY_*
    NEMO_RL_* XDG_CACHE_HOME SSL_CERT_FILE SSL_CERT_DIR REQUESTS_CA_BUNDLE'
  local -a keep=()
  local name pattern
  for name in $(compgen -e); do
    for pattern in $base ${NRL_ENV_PASSTHROUGH:-}; do
      # shellcheck disable=SC2053
      if [[ $name == $pattern ]]; then
        keep+=("$name=${!name}")
        break
      fi
    done
  done
  exec env -i "${keep[@]}" "$@"
}

# nrl_tcp_open HOST PORT: true when HOST:PORT accepts a TCP connection within 2 s.
nrl_tcp_open() {
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

# nrl_wait_tcp HOST PORT TIMEOUT_S PID: wait until HOST:PORT accepts a connection, trying every
# NRL_POLL_S seconds. Returns 1 when PID exits first, 2 when TIMEOUT_S pass.
nrl_wait_tcp() {
  local host=$1 port=$2 deadline=$((SECONDS + $3)) pid=$4
  while ((SECONDS < deadline)); do
    kill -0 "$pid" 2>/dev/null || return 1
    nrl_tcp_open "$host" "$port" && return 0
    sleep "${NRL_POLL_S:-1}"
  done
  return 2
}

# Ray processes the monitor watches: their pids (srun steps or process groups), labels and logs.
NRL_RAY_PIDS=()
NRL_RAY_LABELS=()
NRL_RAY_LOGS=()

# nrl_watch PID LABEL LOG: add a Ray process to the watch list.
nrl_watch() {
  NRL_RAY_PIDS+=("$1")
  NRL_RAY_LABELS+=("$2")
  NRL_RAY_LOGS+=("$3")
}

# nrl_monitor PID: wait for PID to exit, leaving its exit code in NRL_MONITOR_RC; an empty PID
# waits until a signal arrives. Fails the job (NRL_EXIT_NODE_DIED) as soon as a watched Ray
# process ends first. Checks every NRL_POLL_S seconds; signals interrupt the wait at once.
nrl_monitor() {
  local pid=$1 i rc
  while [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null; do
    for i in "${!NRL_RAY_PIDS[@]}"; do
      if ! kill -0 "${NRL_RAY_PIDS[$i]}" 2>/dev/null; then
        wait "${NRL_RAY_PIDS[$i]}"
        rc=$?
        nrl_fail "$NRL_EXIT_NODE_DIED" "the ${NRL_RAY_LABELS[$i]} ended (exit code $rc) while" \
          "the job was running; stopping the job. Its log: ${NRL_RAY_LOGS[$i]}"
      fi
    done
    sleep "${NRL_POLL_S:-1}" &
    wait $!
  done
  wait "$pid"
  NRL_MONITOR_RC=$?
}

# nrl_stop TIMEOUT_S TARGET...: SIGTERM each TARGET (a pid, or -PGID for a process group), wait
# up to TIMEOUT_S for all to exit, then SIGKILL those left.
nrl_stop() {
  local deadline=$((SECONDS + $1)) target alive
  shift
  (($#)) || return 0
  for target in "$@"; do kill -TERM -- "$target" 2>/dev/null; done
  while ((SECONDS < deadline)); do
    alive=0
    for target in "$@"; do kill -0 -- "$target" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.5
  done
  for target in "$@"; do kill -KILL -- "$target" 2>/dev/null; done
  return 0
}

# nrl_requeue_if_resumable RC: inside a slurm job with NRL_REQUEUE=1 (sbatch --requeue), put the
# job back in the queue (same id; slurm runs its script again, whose driver resumes from the
# newest checkpoint) when its exit code RC says the run can resume: 75 (the driver stopped
# early after saving, or a worker died or hung) or NRL_EXIT_NODE_DIED; at most
# NRL_MAX_REQUEUES (default 3) times, counted by slurm's SLURM_RESTART_COUNT.
nrl_requeue_if_resumable() {
  local rc=$1 restarts=${SLURM_RESTART_COUNT:-0} max=${NRL_MAX_REQUEUES:-3} why out
  [[ ${NRL_REQUEUE:-0} == 1 ]] || return 0
  case $rc in
    75) why="the driver exited with code 75 (a rerun resumes the run)" ;;
    "$NRL_EXIT_NODE_DIED") why="a Ray node died (exit code $rc)" ;;
    *) return 0 ;;
  esac
  if ((restarts >= max)); then
    nrl_log "$why; not requeued: job $SLURM_JOB_ID was requeued $restarts time(s) already" \
      "(--max-requeues $max)"
    return 0
  fi
  nrl_log "$why: requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most" \
    "$max); it resumes from the newest checkpoint"
  out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1) ||
    printf '[nemo-rl launch %(%H:%M:%S)T] error: %s\n' -1 "scontrol requeue failed: $out" >&2
}

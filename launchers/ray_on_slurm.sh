# Ray on slurm: the body of the job script `nemo-rl launch slurm` renders (its #SBATCH header and
# NRL_* settings first, then ray_common.sh, then this file). Runs as the batch step on the first
# node of the allocation:
#   1. one Ray node per slurm node: the head on the first node, workers on the others, each an
#      `srun --overlap` step running `ray start --block` (inside the container, if any);
#   2. waits for the head to answer, then for every node to register (naming the missing ones);
#   3. runs the driver command ("$@") as a step on the head node with RAY_ADDRESS set, or, in
#      attach mode (NRL_ATTACH=1, no command), keeps Ray up for `attach.sh` shells;
#   4. exits with the driver's exit code; any Ray step ending early fails the job at once;
#      Ray is torn down on exit, failure, scancel and the time limit (traps). SIGUSR1/SIGUSR2
#      (sbatch --signal=B:USR1@N, `scancel -b -s USR1`) go to the driver and the job goes on:
#      the driver saves and stops by itself (exit 75, docs/cluster.md);
#   5. with NRL_REQUEUE=1 (sbatch --requeue), a job whose run can resume (the driver exited 75,
#      or a Ray node died: exit 5) requeues itself after the teardown, at most
#      NRL_MAX_REQUEUES times (SLURM_RESTART_COUNT); the requeued job resumes the run.
# Logs: $NRL_LOG_DIR/$SLURM_JOB_ID/ (driver.log, ray-<role>-<node>.log, attach.sh, sbatch.sh).
set -uo pipefail
unset RAY_ADDRESS # the driver gets the address of this job's cluster, nothing else does

: "${SLURM_JOB_ID:?ray_on_slurm.sh runs inside a slurm batch job (submit it with sbatch)}"
: "${NRL_LOG_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/results/slurm}"
: "${NRL_RAY_WORKER_PORTS:=1000}"
: "${NRL_RAY_PORT_BASE:=}"
: "${NRL_CPUS_PER_NODE:=${SLURM_CPUS_ON_NODE:-}}"
: "${NRL_GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-0}}"
: "${NRL_RAY_NUM_CPUS:=$NRL_CPUS_PER_NODE}"
: "${NRL_RAY_TEMP_DIR:=/tmp/ray-$SLURM_JOB_ID}"
: "${NRL_RAY:=ray}"
: "${NRL_PYTHON:=python3}"
: "${NRL_HEAD_TIMEOUT_S:=180}"
: "${NRL_NODES_TIMEOUT_S:=600}"
: "${NRL_TEARDOWN_TIMEOUT_S:=60}"
: "${NRL_ATTACH:=0}"
: "${NRL_CONTAINER_IMAGE:=}"
: "${NRL_CONTAINER_MOUNTS:=}"
: "${NRL_CONTAINER_WORKDIR:=}"
export NRL_ENV_PASSTHROUGH="${NRL_ENV_PASSTHROUGH:-}"
# `ray start --block` drains for 30 s on SIGTERM by default (for Ray Serve); stop at once.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

if [[ $NRL_ATTACH == 1 ]]; then
  (($# == 0)) || nrl_fail "$NRL_EXIT_USAGE" "attach mode (--attach) takes no driver command"
else
  (($#)) || nrl_fail "$NRL_EXIT_USAGE" "no driver command: give it after '--', or use --attach"
fi

JOB_DIR=$NRL_LOG_DIR/$SLURM_JOB_ID
mkdir -p "$JOB_DIR" ||
  nrl_fail "$NRL_EXIT_USAGE" "cannot create the log folder $JOB_DIR (--log-dir)"
cp "$0" "$JOB_DIR/sbatch.sh" 2>/dev/null
batch_out=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p')
[[ -n $batch_out ]] && ln -sfn "$batch_out" "$JOB_DIR/slurm.out"

# --- nodes and their addresses ----------------------------------------------------------------
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${#NODES[@]})) || nrl_fail "$NRL_EXIT_USAGE" "no nodes in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"

# nrl_node_address NODE: slurm's NodeAddr of NODE as an IPv4 address (the address the cluster
# reaches the node at; `hostname -I` on the node may list others, or none).
nrl_node_address() {
  local address
  address=$(scontrol show node "$1" -o 2>/dev/null | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
  address=${address:-$1}
  if [[ ! $address =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
    address=$(getent ahostsv4 "$address" | awk 'NR == 1 { print $1 }')
  fi
  echo "$address"
}

ADDRESSES=()
BLOCKS=() # port block of each node: how many earlier nodes share its address
max_block=0
for i in "${!NODES[@]}"; do
  ADDRESSES[i]=$(nrl_node_address "${NODES[i]}")
  [[ -n ${ADDRESSES[i]} ]] || nrl_fail "$NRL_EXIT_USAGE" \
    "cannot resolve an IPv4 address for node ${NODES[i]} (scontrol show node: NodeAddr)"
  BLOCKS[i]=0
  for ((j = 0; j < i; j++)); do
    [[ ${ADDRESSES[j]} == "${ADDRESSES[i]}" ]] && BLOCKS[i]=$((BLOCKS[i] + 1))
  done
  ((BLOCKS[i] > max_block)) && max_block=${BLOCKS[i]}
done
span=$(nrl_port_span $((max_block + 1)))
[[ -n $NRL_RAY_PORT_BASE ]] || NRL_RAY_PORT_BASE=$(nrl_default_port_base "$span" "$SLURM_JOB_ID")
nrl_check_ports "$span"

HEAD_NODE=${NODES[0]}
HEAD_ADDRESS=${ADDRESSES[0]}
RAY_ADDRESS_VALUE=$HEAD_ADDRESS:$NRL_RAY_PORT_BASE

# --- steps ------------------------------------------------------------------------------------
CONTAINER_ARGS=()
if [[ -n $NRL_CONTAINER_IMAGE ]]; then
  # Named, so every step on a node (and attach.sh) shares one container (pyxis).
  CONTAINER_ARGS=(--container-image="$NRL_CONTAINER_IMAGE" --container-name=nemo-rl)
fi
[[ -n $NRL_CONTAINER_MOUNTS ]] && CONTAINER_ARGS+=(--container-mounts="$NRL_CONTAINER_MOUNTS")
[[ -n $NRL_CONTAINER_WORKDIR ]] && CONTAINER_ARGS+=(--container-workdir="$NRL_CONTAINER_WORKDIR")
STEP_CPUS=()
[[ -n $NRL_CPUS_PER_NODE ]] && STEP_CPUS=(--cpus-per-task="$NRL_CPUS_PER_NODE")

# srun_step NAME NODE CMD...: the srun command line of a one-task step NAME on NODE, in the
# array STEP. --overlap lets the Ray, check and driver steps share the node's resources.
srun_step() {
  local name=$1 node=$2
  shift 2
  STEP=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --job-name="$name"
    "${STEP_CPUS[@]}" "${CONTAINER_ARGS[@]}" "$@")
}

# start_ray_node ROLE INDEX: a background step running `ray start --block` on node INDEX, with
# the filtered environment of nrl_exec_with_ray_env, a "slurm_node:<name>" resource (so the
# node is known by its slurm name, even when nodes share an address) and the same name as the
# label "slurm_node" (which Ray keeps for a dead node: fault messages name a lost node by it).
start_ray_node() {
  local role=$1 i=$2
  local node=${NODES[i]} log=$JOB_DIR/ray-$1-${NODES[i]}.log
  nrl_ray_start_args "$role" "${ADDRESSES[i]}" "${BLOCKS[i]}" "$HEAD_ADDRESS"
  NRL_RAY_ARGS+=(--resources="{\"slurm_node:$node\": 1}" --labels="slurm_node=$node")
  srun_step "ray-$role-$node" "$node" --output="$log" \
    bash -c "$(declare -f nrl_exec_with_ray_env); nrl_exec_with_ray_env \"\$@\"" nrl-ray \
    "$NRL_RAY" "${NRL_RAY_ARGS[@]}"
  "${STEP[@]}" &
  nrl_watch $! "Ray $role step on $node (step ray-$role-$node)" "$log"
}

write_attach_script() {
  local script=$JOB_DIR/attach.sh
  local -a attach=(srun --jobid="$SLURM_JOB_ID" --overlap --nodes=1 --ntasks=1
    --nodelist="$HEAD_NODE")
  [[ -n $NRL_CONTAINER_IMAGE ]] && attach+=(--container-name=nemo-rl)
  [[ -n $NRL_CONTAINER_MOUNTS ]] && attach+=(--container-mounts="$NRL_CONTAINER_MOUNTS")
  [[ -n $NRL_CONTAINER_WORKDIR ]] && attach+=(--container-workdir="$NRL_CONTAINER_WORKDIR")
  attach+=(--export="ALL,RAY_ADDRESS=$RAY_ADDRESS_VALUE" --pty bash -i)
  {
    echo '#!/bin/bash'
    echo "# Opens a shell on $HEAD_NODE, the Ray head of slurm job $SLURM_JOB_ID, with"
    echo "# RAY_ADDRESS=$RAY_ADDRESS_VALUE set (\`ray status\`, or run a driver)."
    printf 'exec'
    printf ' %q' "${attach[@]}"
    echo
  } >"$script"
  chmod +x "$script"
}

DRIVER_PID=
CHECK_PID=
teardown() {
  local rc=$? # the job's exit code
  trap - EXIT
  trap '' TERM INT HUP # finish the teardown; slurm sends SIGKILL after KillWait anyway
  [[ -n $DRIVER_PID ]] && nrl_stop "$NRL_TEARDOWN_TIMEOUT_S" "$DRIVER_PID"
  [[ -n $CHECK_PID ]] && nrl_stop 5 "$CHECK_PID"
  if ((${#NRL_RAY_PIDS[@]})); then
    nrl_log "stopping Ray on ${#NRL_RAY_PIDS[@]} node(s)"
    # Workers first, the head (index 0) last, all within one timeout.
    nrl_stop "$NRL_TEARDOWN_TIMEOUT_S" $(printf '%s\n' "${NRL_RAY_PIDS[@]}" | tac)
  fi
  nrl_requeue_if_resumable "$rc"
}
on_signal() {
  nrl_log "received SIG$1 (scancel, the time limit or Ctrl-C); stopping the job"
  exit $((128 + $(kill -l "$1")))
}
# forward_to_driver SIG: pass a stop request (ahead of the time limit) to the driver step (srun
# hands it to the driver process); Ray stays up while the driver saves.
forward_to_driver() {
  if [[ -n $DRIVER_PID ]]; then
    nrl_log "received SIG$1; passing it to the driver (it finishes its step, saves and stops)"
    kill -"$1" "$DRIVER_PID" 2>/dev/null
  else
    nrl_log "received SIG$1 before the driver started; ignored"
  fi
}
trap teardown EXIT
for sig in TERM INT HUP; do
  # shellcheck disable=SC2064
  trap "on_signal $sig" "$sig"
done
for sig in USR1 USR2; do
  # shellcheck disable=SC2064
  trap "forward_to_driver $sig" "$sig"
done

# --- run ----------------------------------------------------------------------------------------
restarted=
((${SLURM_RESTART_COUNT:-0} > 0)) && restarted=" (requeued: restart $SLURM_RESTART_COUNT)"
nrl_log "job $SLURM_JOB_ID$restarted: ${#NODES[@]} node(s) (${NODES[*]}), Ray head on" \
  "$HEAD_NODE at $RAY_ADDRESS_VALUE, ports $NRL_RAY_PORT_BASE-$((NRL_RAY_PORT_BASE + span - 1))," \
  "logs $JOB_DIR"
start_ray_node head 0
HEAD_PID=${NRL_RAY_PIDS[0]}
if ! nrl_wait_tcp "$HEAD_ADDRESS" "$NRL_RAY_PORT_BASE" "$NRL_HEAD_TIMEOUT_S" "$HEAD_PID"; then
  if kill -0 "$HEAD_PID" 2>/dev/null; then
    why="did not answer within $NRL_HEAD_TIMEOUT_S s (--head-timeout-s)"
  else
    why="exited before answering"
  fi
  nrl_fail "$NRL_EXIT_HEAD" "the Ray head on $HEAD_NODE ($RAY_ADDRESS_VALUE) $why;" \
    "see $JOB_DIR/ray-head-$HEAD_NODE.log"
fi
for ((i = 1; i < ${#NODES[@]}; i++)); do start_ray_node worker "$i"; done
write_attach_script

node_list=$(IFS=,; echo "${NODES[*]}")
srun_step wait-for-nodes "$HEAD_NODE" "$NRL_PYTHON" -m nemo_rl.launch.wait_for_nodes \
  --address "$RAY_ADDRESS_VALUE" --nodes "$node_list" --timeout-s "$NRL_NODES_TIMEOUT_S" \
  --poll-s "${NRL_POLL_S:-1}"
"${STEP[@]}" &
CHECK_PID=$!
nrl_monitor "$CHECK_PID"
CHECK_PID=
if ((NRL_MONITOR_RC != 0)); then
  nrl_fail "$NRL_EXIT_NODES" "not every Ray node registered (check exit code $NRL_MONITOR_RC," \
    "message above); the node logs are $JOB_DIR/ray-*.log"
fi

if [[ $NRL_ATTACH == 1 ]]; then
  nrl_log "attach mode: Ray is up on ${#NODES[@]} node(s); open a shell with:" \
    "bash $JOB_DIR/attach.sh" \
    "(scancel $SLURM_JOB_ID ends the job)"
  nrl_monitor ""
fi

nrl_log "driver on $HEAD_NODE: $* (log $JOB_DIR/driver.log)"
srun_step driver "$HEAD_NODE" --export="ALL,RAY_ADDRESS=$RAY_ADDRESS_VALUE" "$@"
"${STEP[@]}" > >(tee -a "$JOB_DIR/driver.log") 2>&1 &
DRIVER_PID=$!
nrl_monitor "$DRIVER_PID"
DRIVER_PID=
nrl_log "driver exited with code $NRL_MONITOR_RC"
exit "$NRL_MONITOR_RC"

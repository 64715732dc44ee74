#!/usr/bin/env bash
# One machine: start a Ray head on 127.0.0.1 with pinned ports, run "$@" with RAY_ADDRESS set,
# exit with its exit code, and stop Ray on exit, failure or signal (SIGINT/SIGTERM/SIGHUP are
# forwarded to the command first). Started by `nemo-rl launch local`; settings are NRL_*
# variables (launchers/README.md). Ray and the command each run in a process group of their
# own, stopped as a whole, so no Ray process outlives the launcher.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ray_common.sh"

(($#)) || nrl_fail "$NRL_EXIT_USAGE" "no command to run: give it after '--'"
: "${NRL_RAY_PORT_BASE:=20000}"
: "${NRL_RAY_WORKER_PORTS:=1000}"
: "${NRL_RAY_NUM_CPUS:=}"
: "${NRL_GPUS_PER_NODE:=}"
: "${NRL_RAY_TEMP_DIR:=}"
: "${NRL_RAY:=ray}"
: "${NRL_LOG_DIR:=results/launch_local}"
: "${NRL_HEAD_TIMEOUT_S:=60}"
: "${NRL_TEARDOWN_TIMEOUT_S:=30}"
unset RAY_ADDRESS
# Keep the node on 127.0.0.1 (Ray otherwise advertises the machine's outward address), no auth
# token file, no 30 s drain on SIGTERM. The command inherits these too.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

ADDRESS=127.0.0.1:$NRL_RAY_PORT_BASE
nrl_check_ports "$(nrl_port_span 1)"
if nrl_tcp_open 127.0.0.1 "$NRL_RAY_PORT_BASE"; then
  nrl_fail "$NRL_EXIT_USAGE" "port $NRL_RAY_PORT_BASE on 127.0.0.1 is in use (another Ray" \
    "head?); choose another --ray-port-base (NRL_RAY_PORT_BASE)"
fi
mkdir -p "$NRL_LOG_DIR" || nrl_fail "$NRL_EXIT_USAGE" "cannot create $NRL_LOG_DIR (--log-dir)"
HEAD_LOG=$NRL_LOG_DIR/ray-head-$(date +%Y%m%d-%H%M%S)-$$.log

HEAD_PID=
COMMAND_PID=
teardown() {
  trap - EXIT
  trap '' TERM INT HUP
  [[ -n $COMMAND_PID ]] && nrl_stop "$NRL_TEARDOWN_TIMEOUT_S" "-$COMMAND_PID"
  if [[ -n $HEAD_PID ]]; then
    nrl_stop "$NRL_TEARDOWN_TIMEOUT_S" "$HEAD_PID" # `ray start` stops its own processes...
    kill -KILL -- "-$HEAD_PID" 2>/dev/null         # ...and anything of its group left over
  fi
}
on_signal() {
  nrl_log "received SIG$1; stopping the command and Ray"
  if [[ -n $COMMAND_PID ]]; then
    kill -"$1" -- "-$COMMAND_PID" 2>/dev/null
    local deadline=$((SECONDS + NRL_TEARDOWN_TIMEOUT_S))
    while kill -0 -- "-$COMMAND_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  fi
  exit $((128 + $(kill -l "$1")))
}
trap teardown EXIT
for sig in TERM INT HUP; do
  # shellcheck disable=SC2064
  trap "on_signal $sig" "$sig"
done

nrl_ray_start_args head 127.0.0.1 0
setsid bash -c "$(declare -f nrl_exec_with_ray_env); nrl_exec_with_ray_env \"\$@\"" nrl-ray \
  "$NRL_RAY" "${NRL_RAY_ARGS[@]}" >"$HEAD_LOG" 2>&1 &
HEAD_PID=$!
nrl_watch "$HEAD_PID" "Ray head (pid $HEAD_PID)" "$HEAD_LOG"
if ! nrl_wait_tcp 127.0.0.1 "$NRL_RAY_PORT_BASE" "$NRL_HEAD_TIMEOUT_S" "$HEAD_PID"; then
  why="exited before answering"
  if kill -0 "$HEAD_PID" 2>/dev/null; then
    why="did not answer within $NRL_HEAD_TIMEOUT_S s (--head-timeout-s)"
  fi
  nrl_fail "$NRL_EXIT_HEAD" "the Ray head ($ADDRESS) $why; see $HEAD_LOG"
fi
nrl_log "Ray head up at $ADDRESS (pid $HEAD_PID, log $HEAD_LOG); running: $*"

RAY_ADDRESS=$ADDRESS setsid "$@" &
COMMAND_PID=$!
nrl_monitor "$COMMAND_PID" # teardown then stops what the command left in its group
exit "$NRL_MONITOR_RC"

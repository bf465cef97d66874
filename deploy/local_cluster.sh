#!/usr/bin/env bash
# A real multi-process Ray cluster on one machine (a head node plus one worker node), the drafter
# service on it, and the verifier server in front; then tear it all down.
#
#   deploy/local_cluster.sh up [MODEL_DIR]   start everything (MODEL_DIR default: a random tiny model)
#   deploy/local_cluster.sh demo             up, one streamed and one JSON request, status, down
#   deploy/local_cluster.sh status           Ray nodes and service health
#   deploy/local_cluster.sh down             stop the services and this cluster's Ray processes only
#
# Env: STREE_LOCAL_DIR (state dir, default /tmp/stree-local), STREE (the stree command), RAY (the ray
# command), RAY_PORT, DRAFTER_PORT, SERVE_PORT, METRICS_PORT (free ones picked when unset).
# Ray token auth is on (RAY_AUTH_MODE=token); the token lives in $STREE_LOCAL_DIR/auth_token and every
# process started here gets it through RAY_AUTH_TOKEN_PATH. Teardown never runs `ray stop` (which would
# kill every Ray process on the machine): it stops exactly the processes this cluster started.
set -euo pipefail

DIR="${STREE_LOCAL_DIR:-/tmp/stree-local}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV_BIN="$HERE/../.venv/bin"
if [[ -z "${STREE:-}" ]]; then
  if [[ -x "$VENV_BIN/stree" ]]; then STREE="$VENV_BIN/stree"; else STREE="stree"; fi
fi
if [[ -z "${RAY:-}" ]]; then
  if [[ -x "$VENV_BIN/ray" ]]; then RAY="$VENV_BIN/ray"; else RAY="ray"; fi
fi
PYTHON="$(dirname "$(command -v "$STREE")")/python"
[[ -x "$PYTHON" ]] || PYTHON="python3"

export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$DIR/auth_token"
export RAY_USAGE_STATS_ENABLED=0

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_healthy() {  # $1 = HOST:PORT, $2 = what, $3 = pid
  for _ in $(seq 1 240); do
    if "$STREE" client health --server "$1" --timeout 1 >/dev/null 2>&1; then echo "$2 is SERVING on $1"; return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then echo "$2 exited; log:" >&2; tail -n 30 "$DIR/$2.log" >&2; return 1; fi
    sleep 0.5
  done
  echo "$2 did not become healthy on $1" >&2
  return 1
}

up() {
  if [[ -f "$DIR/ports.env" ]]; then echo "already up (state in $DIR); run '$0 down' first" >&2; exit 1; fi
  mkdir -p "$DIR"
  "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$DIR/auth_token"
  chmod 600 "$DIR/auth_token"
  local model="${1:-}"
  if [[ -z "$model" ]]; then
    model="$DIR/model"
    [[ -f "$model/config.json" ]] || "$STREE" init-model "$model" --d-model 64 --n-layer 2 --vocab-size 512 >/dev/null
  fi
  RAY_PORT="${RAY_PORT:-$(free_port)}"; DRAFTER_PORT="${DRAFTER_PORT:-$(free_port)}"
  SERVE_PORT="${SERVE_PORT:-$(free_port)}"; METRICS_PORT="${METRICS_PORT:-$(free_port)}"
  printf 'RAY_PORT=%s\nDRAFTER_PORT=%s\nSERVE_PORT=%s\nMETRICS_PORT=%s\nMODEL=%s\n' \
    "$RAY_PORT" "$DRAFTER_PORT" "$SERVE_PORT" "$METRICS_PORT" "$model" > "$DIR/ports.env"

  # Head node (1 CPU) and one worker node (2 CPUs) as separate raylets sharing this machine.
  # Each `ray start` runs in a session of its own (its id saved): teardown ends every process of those
  # sessions, including daemons that name no temp dir in their arguments (ray.util.client.server).
  setsid bash -c 'echo $$ > "$0/ray-head.sid"; exec "$@"' "$DIR" \
    "$RAY" start --head --node-ip-address 127.0.0.1 --port "$RAY_PORT" --num-cpus 1 --num-gpus 0 \
    --include-dashboard false --temp-dir "$DIR/ray" --disable-usage-stats > "$DIR/ray-head.log" 2>&1
  setsid bash -c 'echo $$ > "$0/ray-worker.sid"; exec "$@"' "$DIR" \
    "$RAY" start --address "127.0.0.1:$RAY_PORT" --node-ip-address 127.0.0.1 --num-cpus 2 --num-gpus 0 \
    --resources '{"stree_worker_node": 1}' > "$DIR/ray-worker.log" 2>&1
  echo "Ray cluster up: head + 1 worker on 127.0.0.1:$RAY_PORT"

  # The drafter service is a Ray driver on the head; its actors spread over both nodes.
  "$STREE" drafter-service --ray-address "127.0.0.1:$RAY_PORT" --host 127.0.0.1 --port "$DRAFTER_PORT" \
    --drafters ngram,chain --draft-model "$model" --replicas 2 > "$DIR/drafter-service.log" 2>&1 &
  echo $! > "$DIR/drafter-service.pid"
  wait_healthy "127.0.0.1:$DRAFTER_PORT" drafter-service "$(cat "$DIR/drafter-service.pid")"

  "$STREE" serve "$model" --bind 127.0.0.1 --port "$SERVE_PORT" --metrics-port "$METRICS_PORT" \
    --drafter "grpc://127.0.0.1:$DRAFTER_PORT/chain" > "$DIR/serve.log" 2>&1 &
  echo $! > "$DIR/serve.pid"
  wait_healthy "127.0.0.1:$SERVE_PORT" serve "$(cat "$DIR/serve.pid")"
  echo "try: $STREE client generate --server 127.0.0.1:$SERVE_PORT --prompt-ids 1,2,3 --max-new-tokens 32 --json"
  echo "metrics: http://127.0.0.1:$METRICS_PORT/metrics"
}

status() {
  # shellcheck disable=SC1091
  source "$DIR/ports.env"
  "$RAY" status --address "127.0.0.1:$RAY_PORT" | sed -n '1,12p'
  echo "drafter-service: $("$STREE" client health --server "127.0.0.1:$DRAFTER_PORT" || true)"
  echo "serve:           $("$STREE" client health --server "127.0.0.1:$SERVE_PORT" || true)"
}

descendants() {  # all descendant pids of the given pids
  local kids
  for pid in "$@"; do
    kids="$(ps -eo pid=,ppid= | awk -v p="$pid" '$2 == p {print $1}')"
    for k in $kids; do echo "$k"; descendants "$k"; done
  done
}

stop_pids() {  # SIGTERM, wait up to 10 s, then SIGKILL what is left
  [[ $# -gt 0 ]] || return 0
  kill "$@" 2>/dev/null || true
  for _ in $(seq 1 20); do
    local alive=()
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [[ ${#alive[@]} -eq 0 ]] && return 0
    sleep 0.5
  done
  kill -9 "${alive[@]}" 2>/dev/null || true
}

down() {
  for svc in serve drafter-service; do
    if [[ -f "$DIR/$svc.pid" ]]; then stop_pids "$(cat "$DIR/$svc.pid")"; rm -f "$DIR/$svc.pid"; fi
  done
  # This cluster's Ray daemons are the processes started with our own temp dir in their arguments;
  # their children (workers, agents) go with them.
  local roots=() all=()
  if [[ -d "$DIR/ray" ]]; then
    while read -r pid args; do
      [[ "$args" == *"$DIR/ray"* ]] && roots+=("$pid")
    done < <(ps -eo pid=,args=)
  fi
  local sids=()
  for f in "$DIR"/ray-*.sid; do [[ -f "$f" ]] && sids+=("$(cat "$f")"); done
  if [[ ${#sids[@]} -gt 0 ]]; then
    while read -r pid sid; do
      for s in "${sids[@]}"; do [[ "$sid" == "$s" ]] && roots+=("$pid"); done
    done < <(ps -eo pid=,sid=)
  fi
  rm -f "$DIR"/ray-*.sid
  if [[ ${#roots[@]} -gt 0 ]]; then
    mapfile -t all < <(printf '%s\n' "${roots[@]}"; descendants "${roots[@]}")
    stop_pids "${all[@]}"
  fi
  rm -f "$DIR/ports.env"
  echo "stopped (${#all[@]} Ray processes)"
}

demo() {
  up "${1:-}"
  trap down EXIT
  # shellcheck disable=SC1091
  source "$DIR/ports.env"
  "$STREE" client generate --server "127.0.0.1:$SERVE_PORT" --prompt-ids 5,9,13,2,7,9,13,2 --max-new-tokens 48 --stream
  "$STREE" client generate --server "127.0.0.1:$SERVE_PORT" --prompt-ids 5,9,13,2,7,9,13,2 --max-new-tokens 48 \
    --drafter ngram --json
  status
  curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null | grep -E '^stree:(spec_decode_num_[a-z_]*_total|generation_tokens_total|drafter_fallbacks_total)' || true
}

case "${1:-}" in
  up) shift; up "${1:-}" ;;
  down) down ;;
  status) status ;;
  demo) shift; demo "${1:-}" ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# The observability services of `make run-observe`: Arize Phoenix (the trace UI, receiving OTLP over HTTP)
# and Prometheus (infra/prometheus/prometheus.yml: scrapes sluice, evaluates the alert rules).
#   infra/observe.sh start STATE_DIR      Phoenix on 127.0.0.1:$SLUICE_PHOENIX_PORT (6006), Prometheus on :$SLUICE_PROMETHEUS_PORT (9090)
#   infra/observe.sh stop STATE_DIR
# Both bind 127.0.0.1 only; each is recorded by pid in STATE_DIR and stopped by pid. Neither starts on a
# port another process holds (that process's answer would pass the wait for ours).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/infra/common.sh"
phoenix_port=${SLUICE_PHOENIX_PORT:-6006}
prometheus_port=${SLUICE_PROMETHEUS_PORT:-9090}

wait_http() {  # wait_http URL NAME PIDFILE LOG SECONDS: until URL answers, while the pid in PIDFILE lives
  for _ in $(seq 1 $(($5 * 2))); do
    if ! kill -0 "$(cat "$3")" 2>/dev/null; then  # first: its port, not another's
      echo "$2 exited; the end of $4:" >&2
      tail -n 20 "$4" >&2
      return 1
    fi
    curl -fs -o /dev/null "$1" && return 0
    sleep 0.5
  done
  echo "$2 did not answer at $1 within $5 s; see $4" >&2
  return 1
}

case ${1:-} in
  start)
    mkdir -p "$2/phoenix" "$2/prometheus"; state=$(cd "$2" && pwd)
    refuse_taken_port Phoenix "$phoenix_port" $((phoenix_port + 1))
    refuse_taken_port Prometheus "$prometheus_port"
    PHOENIX_WORKING_DIR="$state/phoenix" PHOENIX_HOST=127.0.0.1 PHOENIX_PORT="$phoenix_port" \
      PHOENIX_GRPC_PORT=$((phoenix_port + 1)) PHOENIX_TELEMETRY_ENABLED=false \
      nohup "$root/.venv-phoenix/bin/phoenix" serve >"$state/phoenix.log" 2>&1 &
    echo $! >"$state/phoenix.pid"
    prometheus --config.file="$root/infra/prometheus/prometheus.yml" --storage.tsdb.path="$state/prometheus" \
      --web.listen-address="127.0.0.1:$prometheus_port" >"$state/prometheus.log" 2>&1 &
    echo $! >"$state/prometheus.pid"
    wait_http "http://127.0.0.1:$prometheus_port/-/ready" Prometheus "$state/prometheus.pid" "$state/prometheus.log" 30
    wait_http "http://127.0.0.1:$phoenix_port/" Phoenix "$state/phoenix.pid" "$state/phoenix.log" 120  # first start migrates its database
    ;;
  stop)
    mkdir -p "$2"; state=$(cd "$2" && pwd)
    for name in prometheus phoenix; do
      file="$state/$name.pid"
      [ -f "$file" ] || continue
      pid=$(cat "$file")
      # only if that pid is still ours: a pid file left by a crash may name another process by now
      if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$name"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
      fi
      rm -f "$file"
    done
    ;;
  *)
    echo "usage: $0 start STATE_DIR | stop STATE_DIR" >&2
    exit 2
    ;;
esac

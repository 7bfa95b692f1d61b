#!/usr/bin/env bash
# Starts or stops the local Kafka and Redis that sluice runs on.
#   infra/services.sh start STATE_DIR KAFKA_PORT REDIS_PORT
#   infra/services.sh stop STATE_DIR
# Everything started is recorded by pid in STATE_DIR and stopped by pid, nothing else.
# SLUICE_KAFKA_SECURE=1 / SLUICE_REDIS_SECURE=1 start each in its secure profile (kafka/start.sh,
# redis/start.sh); infra/run.sh sets both for SLUICE_SECURE=1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

stop_pid() {  # stop_pid FILE WHAT: TERM, wait up to 20 s, then KILL, if the pid is still a WHAT process
  local file=$1 what=$2 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  # A pid file left by a crash or a reboot may name some other process by now: stopped only if its
  # command line still says what was started here.
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$what"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

case ${1:-} in
  start)
    mkdir -p "$2"; state=$(cd "$2" && pwd)
    "$here/redis/start.sh" "$state" "$4"
    "$here/kafka/start.sh" "$state" "$3"
    ;;
  stop)
    mkdir -p "$2"; state=$(cd "$2" && pwd)
    stop_pid "$state/kafka.pid" "kafka.Kafka $state/server.properties"
    stop_pid "$state/redis.pid" "redis-server"
    ;;
  *)
    echo "usage: $0 start STATE_DIR KAFKA_PORT REDIS_PORT | stop STATE_DIR" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Starts Redis on 127.0.0.1 in the background with the project's config and waits for PONG.
# Usage: infra/redis/start.sh STATE_DIR PORT  (writes STATE_DIR/redis.pid and STATE_DIR/redis.log)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=$1
port=$2
mkdir -p "$state"
command -v redis-server >/dev/null || { echo "redis-server missing: run 'make setup' first" >&2; exit 1; }
redis-server "$here/redis.conf" --port "$port" --dir "$state" --logfile "$state/redis.log" \
  --pidfile "$state/redis.pid" --daemonize yes
for _ in $(seq 1 50); do
  [ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && exit 0
  sleep 0.1
done
echo "Redis did not answer on port $port" >&2
exit 1

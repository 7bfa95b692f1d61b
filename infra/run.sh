#!/usr/bin/env bash
# `make run`: starts Kafka and Redis (ports from sluice.toml), creates the topics, and runs every stage
# and the bridge in the foreground. Ctrl-C stops all of it, by pid.
# SLUICE_KAFKA_SECURE=1 make run: the broker's secure profile (SASL/SCRAM and ACLs; a state dir keeps
# the profile it was first formatted with, so `make clean` first when switching).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
state="$root/.state/run"
kafka_port=${SLUICE_KAFKA_PORT:-19092}
redis_port=${SLUICE_REDIS_PORT:-16379}
export SLUICE_KAFKA_BOOTSTRAP="127.0.0.1:$kafka_port"
export SLUICE_REDIS_URL="redis://127.0.0.1:$redis_port/0"

pid=""
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  infra/services.sh stop "$state"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
infra/services.sh start "$state" "$kafka_port" "$redis_port"
echo "Kafka on 127.0.0.1:$kafka_port, Redis on 127.0.0.1:$redis_port (logs in $state)"
if [ "${SLUICE_KAFKA_SECURE:-0}" = 1 ]; then  # the secure profile: sluice's stages connect as the super user
  export SLUICE_KAFKA_USER=admin SLUICE_KAFKA_PASSWORD
  SLUICE_KAFKA_PASSWORD=$(cat "$state/kafka-admin.password")
  echo "Kafka: SASL/SCRAM with ACLs; add tenants with infra/kafka/TenantAcls.java (see docs/security.md)"
fi
.venv/bin/sluice topics create
.venv/bin/sluice run &
pid=$!
wait "$pid"
pid=""

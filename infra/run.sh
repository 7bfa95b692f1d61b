#!/usr/bin/env bash
# `make run`: starts Kafka and Redis, creates the topics, and runs every stage and the bridge in the
# foreground. Ctrl-C, or SIGINT/SIGTERM to this script or to `make`, stops all of it, by pid.
# SLUICE_RUN_STATE moves the state directory (default .state/run); one run at a time uses it (a lock on
# STATE/run.lock: a second run on it exits 1 before it starts or stops anything).
# Ports: Kafka on SLUICE_KAFKA_PORT (default 19092; its controller on the next port), Redis on
# SLUICE_REDIS_PORT (default 16379), not from sluice.toml: this script exports SLUICE_KAFKA_BOOTSTRAP and
# SLUICE_REDIS_URL for them, which override sluice.toml's [kafka] bootstrap and [redis] url.
# SLUICE_OBSERVE=1 (make run-observe): also Phoenix (traces) and Prometheus (metrics, alerts), infra/observe.sh.
# SLUICE_SECURE=1 make run: the secure profile, i.e. SLUICE_KAFKA_SECURE=1 (the broker with SASL/SCRAM and
# ACLs; a state dir keeps the profile it was first formatted with, so `make clean` first when switching)
# and SLUICE_REDIS_SECURE=1 (Redis with ACL users and passwords), either of which also works alone.
# Secrets reach sluice's processes in the environment, read from mode-600 files, never as arguments; the
# gateway secret (the bridge's signatures: client information, principal tokens) is SLUICE_GATEWAY_SECRET
# or else one made once in STATE/gateway.secret.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
state=${SLUICE_RUN_STATE:-$root/.state/run}
kafka_port=${SLUICE_KAFKA_PORT:-19092}
redis_port=${SLUICE_REDIS_PORT:-16379}
export SLUICE_KAFKA_BOOTSTRAP="127.0.0.1:$kafka_port"
export SLUICE_REDIS_URL="redis://127.0.0.1:$redis_port/0"

# Another run on this state directory would find its Kafka and Redis "running already" and stop them, by
# pid, when it ends: refused before anything here can stop them. fd 9 holds the lock for this script's
# life; what it starts gets `9>&-`, so a process left behind by a killed run does not keep it locked.
mkdir -p "$state"
exec 9>>"$state/run.lock"
if ! flock -n 9; then
  echo "another run is using $state (its lock $state/run.lock is held): stop it first, or set SLUICE_RUN_STATE and other ports" >&2
  exit 1
fi

pid=""
watcher=""
cleanup() {
  [ -n "$watcher" ] && kill "$watcher" 2>/dev/null || true
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true  # its status must not skip the rest
  infra/services.sh stop "$state"
  if [ "${SLUICE_OBSERVE:-0}" = 1 ]; then infra/observe.sh stop "$state"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# make passes SIGTERM on to its recipe but not SIGINT (it expects a terminal to signal the whole process
# group), and then waits for the recipe forever. Its handler first resets the signal to the default, so
# the signals make catches (SigCgt in /proc) lose SIGINT: seeing that, or make gone, stops this script.
watch_make() {
  local parent=$1 caught initial
  caught=$(awk '/^SigCgt/ {print $2}' "/proc/$parent/status" 2>/dev/null) || return 0
  initial=$((16#$caught & 0x4002))  # SIGINT (bit 1) and SIGTERM (bit 14)
  while sleep 0.5; do
    caught=$(awk '/^SigCgt/ {print $2}' "/proc/$parent/status" 2>/dev/null) || caught=""
    if [ -z "$caught" ] || [ $((16#$caught & 0x4002)) -ne "$initial" ]; then
      kill -TERM $$
      return 0
    fi
  done
}
if [ -n "${SLUICE_RUN_PARENT:-}" ]; then  # set by the Makefile to make's pid
  watch_make "$SLUICE_RUN_PARENT" 9>&- &
  watcher=$!
fi
if [ "${SLUICE_SECURE:-0}" = 1 ]; then
  export SLUICE_KAFKA_SECURE=1 SLUICE_REDIS_SECURE=1
fi
infra/services.sh start "$state" "$kafka_port" "$redis_port" 9>&-
echo "Kafka on 127.0.0.1:$kafka_port, Redis on 127.0.0.1:$redis_port (logs in $state)"
if [ "${SLUICE_OBSERVE:-0}" = 1 ]; then  # make run-observe: the trace UI and Prometheus (infra/observe.sh)
  infra/observe.sh start "$state" 9>&-
  export SLUICE_OTLP_ENDPOINT=${SLUICE_OTLP_ENDPOINT:-http://127.0.0.1:${SLUICE_PHOENIX_PORT:-6006}/v1/traces}
  echo "Traces: Phoenix on http://127.0.0.1:${SLUICE_PHOENIX_PORT:-6006}; Prometheus on http://127.0.0.1:${SLUICE_PROMETHEUS_PORT:-9090} (alerts: /alerts); dashboard: http://127.0.0.1:8080/dashboard"
fi
if [ "${SLUICE_REDIS_SECURE:-0}" = 1 ]; then  # sluice's processes are Redis's ACL user `sluice`
  export SLUICE_REDIS_USER=sluice SLUICE_REDIS_PASSWORD
  SLUICE_REDIS_PASSWORD=$(cat "$state/redis-sluice.password")
  echo "Redis: ACL users only (the operator's: admin, password in $state/redis-admin.password)"
fi
if [ -z "${SLUICE_GATEWAY_SECRET:-}" ]; then
  if [ ! -s "$state/gateway.secret" ]; then
    secret_tmp=$(umask 077; mktemp "$state/gateway.secret.XXXXXX")
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret_tmp"
    mv -f "$secret_tmp" "$state/gateway.secret"
  fi
  export SLUICE_GATEWAY_SECRET
  SLUICE_GATEWAY_SECRET=$(cat "$state/gateway.secret")
fi
if [ "${SLUICE_KAFKA_SECURE:-0}" = 1 ]; then  # the secure profile: sluice's stages connect as the super user
  export SLUICE_KAFKA_USER=admin SLUICE_KAFKA_PASSWORD
  SLUICE_KAFKA_PASSWORD=$(cat "$state/kafka-admin.password")
  echo "Kafka: SASL/SCRAM with ACLs; add tenants with infra/kafka/TenantAcls.java (see docs/security.md)"
fi
.venv/bin/sluice topics create
.venv/bin/sluice run 9>&- &
pid=$!
wait "$pid"
pid=""

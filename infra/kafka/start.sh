#!/usr/bin/env bash
# Starts a single-node Kafka (KRaft) on 127.0.0.1 in the background and waits until it accepts
# connections. Usage: infra/kafka/start.sh STATE_DIR PORT [--secure]  (or SLUICE_KAFKA_SECURE=1)
# Writes STATE_DIR/kafka.pid and STATE_DIR/kafka.log; formats storage once (re-runs are safe).
# --secure: SASL/SCRAM listeners and ACLs (secure.properties.in). The super user `admin` gets a random
# password, created once in STATE_DIR/kafka-admin.password (mode 600) and added at format time;
# tenants are added with infra/kafka/TenantAcls.java. A state dir keeps the profile it was formatted with.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=$1
port=$2
secure=${SLUICE_KAFKA_SECURE:-0}
[ "${3:-}" = "--secure" ] && secure=1
controller_port=$((port + 1))
data="$state/kafka-data"
mkdir -p "$state" "$data"
[ -d "$here/lib" ] || { echo "Kafka jars missing: run 'make setup' first" >&2; exit 1; }

sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$controller_port|g" -e "s|@DATA@|$data|g" \
  "$here/server.properties.in" >"$state/server.properties"
format_extra=()
if [ "$secure" = 1 ]; then
  password_file="$state/kafka-admin.password"
  if [ ! -f "$password_file" ]; then
    (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$password_file")
  fi
  admin_password=$(cat "$password_file")
  (umask 077; sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$controller_port|g" \
    -e "s|@ADMIN_PASSWORD@|$admin_password|g" "$here/secure.properties.in" >>"$state/server.properties")
  format_extra=(--add-scram "SCRAM-SHA-256=[name=admin,password=$admin_password]")
fi

java_opts=(-Xms256m -Xmx512m -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20
  -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true
  "-Dlog4j2.configurationFile=$here/log4j2.yaml" "-Dkafka.logs.dir=$state")
cp="$here/lib/*"

if [ ! -f "$data/meta.properties" ]; then
  cluster_id=$(java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" kafka.tools.StorageTool random-uuid)
  java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" kafka.tools.StorageTool format \
    -t "$cluster_id" -c "$state/server.properties" --ignore-formatted "${format_extra[@]}" >/dev/null
fi

nohup java "${java_opts[@]}" -cp "$cp" kafka.Kafka "$state/server.properties" >"$state/kafka.log" 2>&1 &
echo $! >"$state/kafka.pid"

for _ in $(seq 1 120); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then exit 0; fi
  kill -0 "$(cat "$state/kafka.pid")" 2>/dev/null || { tail -20 "$state/kafka.log" >&2; exit 1; }
  sleep 0.5
done
echo "Kafka did not open port $port in 60 s" >&2
exit 1

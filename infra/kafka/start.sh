#!/usr/bin/env bash
# Starts a single-node Kafka (KRaft) on 127.0.0.1 in the background and waits until it accepts
# connections. Usage: infra/kafka/start.sh STATE_DIR PORT
# Writes STATE_DIR/kafka.pid and STATE_DIR/kafka.log; formats storage once (re-runs are safe).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=$1
port=$2
controller_port=$((port + 1))
data="$state/kafka-data"
mkdir -p "$state" "$data"
[ -d "$here/lib" ] || { echo "Kafka jars missing: run 'make setup' first" >&2; exit 1; }

sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$controller_port|g" -e "s|@DATA@|$data|g" \
  "$here/server.properties.in" >"$state/server.properties"

java_opts=(-Xms256m -Xmx512m -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20
  -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true
  "-Dlog4j2.configurationFile=$here/log4j2.yaml" "-Dkafka.logs.dir=$state")
cp="$here/lib/*"

if [ ! -f "$data/meta.properties" ]; then
  cluster_id=$(java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" kafka.tools.StorageTool random-uuid)
  java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" kafka.tools.StorageTool format \
    -t "$cluster_id" -c "$state/server.properties" --ignore-formatted >/dev/null
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

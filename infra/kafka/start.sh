#!/usr/bin/env bash
# Starts a single-node Kafka (KRaft) on 127.0.0.1 in the background and waits until it accepts
# connections. Usage: infra/kafka/start.sh STATE_DIR PORT [--secure]  (or SLUICE_KAFKA_SECURE=1)
# Writes STATE_DIR/kafka.pid and STATE_DIR/kafka.log; formats storage once (re-runs are safe). Every
# directory and file it or the broker makes is private (umask 077): the segments hold prompts and answers.
# --secure: SASL/SCRAM listeners and ACLs (secure.properties.in). The super user `admin` gets a random
# password, created once in STATE_DIR/kafka-admin.password (mode 600 from its creation, renamed into
# place) and added at format time (from a mode-600 argument file, never on a command line); it is filled
# into server.properties (mode 600 from its creation) by the shell itself, not by a command's arguments;
# tenants are added with infra/kafka/TenantAcls.java. A state dir keeps the profile it was formatted with.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../common.sh"
state=$1
port=$2
secure=${SLUICE_KAFKA_SECURE:-0}
[ "${3:-}" = "--secure" ] && secure=1
controller_port=$((port + 1))
data="$state/kafka-data"
[ -d "$here/lib" ] || { echo "Kafka jars missing: run 'make setup' first" >&2; exit 1; }

# Everything this script and the broker write is private to this user (umask 077, in every profile):
# the segment files hold every prompt and answer, and in the secure profile server.properties holds
# the super user's password (written whole to a private temporary file and renamed into place). The
# broker inherits the umask, so its directories are 700 and its files 600 from their creation; a data
# directory left by an older start (made under umask 022) is made private once.
umask 077
mkdir -p "$state" "$data"
chmod 700 "$state"
[ -z "$(find "$data" -perm /077 -print -quit)" ] || chmod -R go= "$data"
admin_password=""
fill() {  # fill TEMPLATE: its lines with the @...@ placeholders filled in, by bash itself (no argv shows
  # the password in `ps`; quoted replacements, so an `&` in one stays an `&`)
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line//@PORT@/"$port"}
    line=${line//@CONTROLLER_PORT@/"$controller_port"}
    line=${line//@DATA@/"$data"}
    printf '%s\n' "${line//@ADMIN_PASSWORD@/"$admin_password"}"
  done <"$1"
}
properties=$(mktemp "$state/server.properties.XXXXXX")
fill "$here/server.properties.in" >"$properties"
scram=""
if [ "$secure" = 1 ]; then
  password_file="$state/kafka-admin.password"
  # -s: an empty file (a write cut short by an older start) is made again, never used as the password
  [ -s "$password_file" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' | private_file "$password_file"
  admin_password=$(cat "$password_file")
  fill "$here/secure.properties.in" >>"$properties"
  scram="SCRAM-SHA-256=[name=admin,password=$admin_password]"
fi
mv -f "$properties" "$state/server.properties"

java_opts=(-Xms256m -Xmx512m -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20
  -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true
  "-Dlog4j2.configurationFile=$here/log4j2.yaml" "-Dkafka.logs.dir=$state")
cp="$here/lib/*"

if [ ! -f "$data/meta.properties" ]; then
  cluster_id=$(java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" kafka.tools.StorageTool random-uuid)
  # The main class and its arguments go in a java @file (mode 600, removed after): the admin password is
  # never on a command line, where every local user can read it in `ps`.
  format_args=$(mktemp "$state/format.args.XXXXXX")
  printf 'kafka.tools.StorageTool format -t %s -c "%s" --ignore-formatted\n' "$cluster_id" "$state/server.properties" >"$format_args"
  [ -z "$scram" ] || printf -- '--add-scram "%s"\n' "$scram" >>"$format_args"
  java -cp "$cp" "-Dlog4j2.configurationFile=$here/log4j2.yaml" "@$format_args" >/dev/null || { rm -f "$format_args"; exit 1; }
  rm -f "$format_args"
fi

ours() { [ -f "$state/kafka.pid" ] && tr '\0' ' ' <"/proc/$(cat "$state/kafka.pid")/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $state/server.properties"; }
if ours; then echo "Kafka of $state is running already" >&2; exit 0; fi
refuse_taken_port Kafka "$port" "$controller_port"

nohup java "${java_opts[@]}" -cp "$cp" kafka.Kafka "$state/server.properties" >"$state/kafka.log" 2>&1 &
echo $! >"$state/kafka.pid"

for _ in $(seq 1 120); do
  kill -0 "$(cat "$state/kafka.pid")" 2>/dev/null || { tail -20 "$state/kafka.log" >&2; exit 1; }  # first: its port, not another's
  if port_open "$port"; then exit 0; fi
  sleep 0.5
done
echo "Kafka did not open port $port in 60 s" >&2
exit 1

#!/usr/bin/env bash
# Starts Redis on 127.0.0.1 in the background with the project's config and waits for PONG.
# Usage: infra/redis/start.sh STATE_DIR PORT [--secure]  (or SLUICE_REDIS_SECURE=1)
# Writes STATE_DIR/redis.pid and STATE_DIR/redis.log. Everything it and Redis write is private to this
# user (umask 077, in every profile): the append-only file holds key records, spend and per-request state.
# While Redis loads a large append-only file it answers LOADING (about 7 s at the 256 MB cap,
# docs/operations.md): the wait allows 60 s, and fails at once, with the log's end, if Redis exits.
# --secure: no unauthenticated access. The default user is off; two ACL users get random passwords,
# created once in STATE_DIR/redis-sluice.password and redis-admin.password (mode 600 from their creation:
# written under umask 077 to a temporary file and renamed): `sluice` (sluice's processes: only keys under
# `sluice:`, no admin or dangerous commands) and `admin` (the operator). The ACL file (--aclfile, mode 600)
# holds only their SHA-256 hashes; no password is ever an argument. Clients read the password from the
# file or from SLUICE_REDIS_PASSWORD (infra/run.sh exports it; redis-cli takes REDISCLI_AUTH).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../common.sh"
state=$1
port=$2
secure=${SLUICE_REDIS_SECURE:-0}
[ "${3:-}" = "--secure" ] && secure=1
command -v redis-server >/dev/null || { echo "redis-server missing: run 'make setup' first" >&2; exit 1; }

# Redis inherits the umask: its append-only directory is 700 and its files 600 from their creation. Files
# left by an older start (made under umask 022: directory 755, files 644) are made private once.
umask 077
mkdir -p "$state"
for made in "$state/appendonlydir" "$state/redis.log"; do
  [ ! -e "$made" ] || [ -z "$(find "$made" -perm /077 -print -quit)" ] || chmod -R go= "$made"
done

acl=()
ping_user=()
if [ "$secure" = 1 ]; then
  for user in sluice admin; do
    file="$state/redis-$user.password"
    [ -s "$file" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' | private_file "$file"
  done
  sluice_hash=$(tr -d '\n' <"$state/redis-sluice.password" | sha256sum | cut -d' ' -f1)
  admin_hash=$(tr -d '\n' <"$state/redis-admin.password" | sha256sum | cut -d' ' -f1)
  private_file "$state/redis-users.acl" <<ACL
user default off resetkeys resetchannels -@all
user sluice on #$sluice_hash resetkeys ~sluice:* resetchannels +@all -@dangerous -@admin
user admin on #$admin_hash ~* &* +@all
ACL
  acl=(--aclfile "$state/redis-users.acl")
  ping_user=(--user sluice)
  REDISCLI_AUTH=$(cat "$state/redis-sluice.password")
  export REDISCLI_AUTH  # redis-cli's password from the environment, not its arguments
fi

if [ -f "$state/redis.pid" ] && tr '\0' ' ' <"/proc/$(cat "$state/redis.pid")/cmdline" 2>/dev/null | grep -qF "redis-server 127.0.0.1:$port"; then
  echo "Redis of $state is running already" >&2
  exit 0
fi
refuse_taken_port Redis "$port"  # else another process's PONG (or its password prompt) would do
rm -f "$state/redis.pid"  # one left by a crash must not name the server started below
redis-server "$here/redis.conf" --port "$port" --dir "$state" --logfile "$state/redis.log" \
  --pidfile "$state/redis.pid" --daemonize yes "${acl[@]}"
# The daemon writes its pid file at once, then loads the append-only file, answering LOADING until done.
failed() { echo "$1; the end of $state/redis.log:" >&2; tail -n 20 "$state/redis.log" >&2; exit 1; }
started=$SECONDS
loading=""
while [ $((SECONDS - started)) -lt 60 ]; do
  pid=$(cat "$state/redis.pid" 2>/dev/null) || pid=""
  if [ -n "$pid" ]; then  # first: its port, not another's
    kill -0 "$pid" 2>/dev/null || failed "Redis exited"
  elif [ $((SECONDS - started)) -ge 5 ]; then
    failed "Redis is not running (no pid file)"
  fi
  reply=$(redis-cli "${ping_user[@]}" -p "$port" ping 2>/dev/null) || true  # an error reply is on stdout too
  case $reply in
    PONG) exit 0 ;;
    *LOADING*) [ -n "$loading" ] || echo "Redis is loading its append-only file from $state; waiting" >&2
               loading=1 ;;
  esac
  sleep 0.1
done
echo "Redis did not answer on port $port within 60 s (log: $state/redis.log)" >&2
exit 1

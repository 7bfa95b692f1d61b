#!/usr/bin/env bash
# Starts Redis on 127.0.0.1 in the background with the project's config and waits for PONG.
# Usage: infra/redis/start.sh STATE_DIR PORT [--secure]  (or SLUICE_REDIS_SECURE=1)
# Writes STATE_DIR/redis.pid and STATE_DIR/redis.log.
# --secure: no unauthenticated access. The default user is off; two ACL users get random passwords,
# created once in STATE_DIR/redis-sluice.password and redis-admin.password (mode 600 from their creation:
# written under umask 077 to a temporary file and renamed): `sluice` (sluice's processes: only keys under
# `sluice:`, no admin or dangerous commands) and `admin` (the operator). The ACL file (--aclfile, mode 600)
# holds only their SHA-256 hashes; no password is ever an argument. Clients read the password from the
# file or from SLUICE_REDIS_PASSWORD (infra/run.sh exports it; redis-cli takes REDISCLI_AUTH).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=$1
port=$2
secure=${SLUICE_REDIS_SECURE:-0}
[ "${3:-}" = "--secure" ] && secure=1
mkdir -p "$state"
command -v redis-server >/dev/null || { echo "redis-server missing: run 'make setup' first" >&2; exit 1; }

private_file() {  # private_file PATH: PATH's content from stdin, mode 600 from its creation, renamed into place
  local tmp
  tmp=$(umask 077; mktemp "$1.XXXXXX")
  cat >"$tmp"
  mv -f "$tmp" "$1"
}

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

# In the secure profile what Redis writes (the append-only file: key records, spend, per-request state;
# its log) is private to its user too.
[ "$secure" = 1 ] && umask 077
if [ -f "$state/redis.pid" ] && tr '\0' ' ' <"/proc/$(cat "$state/redis.pid")/cmdline" 2>/dev/null | grep -qF "redis-server 127.0.0.1:$port"; then
  echo "Redis of $state is running already" >&2
  exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then  # else another process's PONG (or its password prompt) would do
  echo "port $port is in use by another process: Redis not started" >&2
  exit 1
fi
redis-server "$here/redis.conf" --port "$port" --dir "$state" --logfile "$state/redis.log" \
  --pidfile "$state/redis.pid" --daemonize yes "${acl[@]}"
for _ in $(seq 1 50); do
  [ "$(redis-cli "${ping_user[@]}" -p "$port" ping 2>/dev/null)" = PONG ] && exit 0
  sleep 0.1
done
echo "Redis did not answer on port $port" >&2
exit 1

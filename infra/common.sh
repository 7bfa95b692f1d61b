# Helpers shared by infra/'s service scripts (sourced, not run).

port_open() {  # port_open PORT: something accepts connections on 127.0.0.1:PORT
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

refuse_taken_port() {  # refuse_taken_port WHAT PORT...: exit 1 if another process holds one of them
  local what=$1 port
  shift
  for port in "$@"; do  # else that process's answer would pass the readiness wait for ours
    if port_open "$port"; then
      echo "port $port is in use by another process: $what not started" >&2
      exit 1
    fi
  done
}

private_file() {  # private_file PATH: PATH's content from stdin, mode 600 from its creation, renamed into place
  local tmp
  tmp=$(umask 077; mktemp "$1.XXXXXX")
  cat >"$tmp"
  mv -f "$tmp" "$1"
}

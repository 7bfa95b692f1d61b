#!/usr/bin/env bash
# Triton Inference Server 2.51 (CPU), the binary and Python backend shipped inside the nvidia-pytriton wheel.
#   infra/triton/triton.sh setup                                  build .venv-triton (idempotent)
#   infra/triton/triton.sh start STATE_DIR GRPC_PORT HTTP_PORT [REPO [MODEL...]]
#                                                                 serve REPO (default triton_models/) on
#                                                                 127.0.0.1 in the background, wait until
#                                                                 every MODEL (default sluice_llm) is ready
#   infra/triton/triton.sh stop STATE_DIR                         stop it, by pid
#
# The server runs with --model-control-mode=explicit: only the named models load (triton_models/ also
# holds the TensorRT-LLM repository for GPU hosts, whose backend is not in the wheel). --exit-timeout-secs 5:
# sluice_llm's stub keeps nothing, and once it has served requests its process often outlives Triton's
# default 30 s wait on shutdown (the stub's event-loop thread); a shorter wait only makes `stop` quicker. Its Python backend
# directory is assembled from the wheel in .venv-triton/backends/python: libtriton_python.so,
# triton_python_backend_utils.py and the Python 3.11 stub. The stub embeds libpython3.11 (LD_LIBRARY_PATH:
# the base interpreter's LIBDIR, then the wheel's nvidia_pytriton.libs for the renamed libtritonserver). The
# stub's interpreter runs isolated (no PYTHONPATH) and finds its prefix through `python3` on PATH, so
# .venv-triton/bin goes first on PATH: its site-packages, and the repository root through a .pth file.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/infra/common.sh"
venv="$root/.venv-triton"
lock="$root/infra/triton/requirements.lock.txt"
site="$venv/lib/python3.11/site-packages"

setup() {
  if [ -f "$venv/.installed" ] && cmp -s "$lock" "$venv/.installed"; then
    echo "$root" >"$site/sluice-repository.pth"  # the checkout may have moved
    touch "$venv/.installed"
    return 0  # already built from this lock file
  fi
  test -x "$venv/bin/python" || python3 -m venv "$venv"
  "$venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the bundled stub is for Python 3.11"'
  "$venv/bin/pip" install -q -r "$lock"
  local wheel="$site/pytriton/tritonserver"
  rm -rf "$venv/backends" && mkdir -p "$venv/backends/python"
  cp "$wheel/backends/python/libtriton_python.so" "$wheel/backends/python/triton_python_backend_utils.py" \
     "$wheel/python_backend_stubs/3.11/triton_python_backend_stub" "$venv/backends/python/"
  # sluice itself from the working tree, as an editable install would (the stub runs isolated: it reads no
  # PYTHONPATH, only its interpreter's site-packages and their .pth files).
  echo "$root" >"$site/sluice-repository.pth"
  cp "$lock" "$venv/.installed"
}

ready() {  # ready HTTP_PORT MODEL...: the server and every model answer ready
  local port=$1 model
  shift
  curl -sf "http://127.0.0.1:$port/v2/health/live" >/dev/null || return 1
  for model in "$@"; do
    curl -sf "http://127.0.0.1:$port/v2/models/$model/ready" >/dev/null || return 1
  done
}

start() {
  local state grpc_port=$2 http_port=$3 repo=${4:-$root/triton_models}
  mkdir -p "$1"; state=$(cd "$1" && pwd)
  shift 4 2>/dev/null || shift $#
  local models=("$@")
  [ ${#models[@]} -gt 0 ] || models=(sluice_llm)
  [ -f "$venv/.installed" ] || { echo "triton: $venv is missing: run \`make setup\`" >&2; exit 1; }
  local libdir load=()
  libdir=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
  for model in "${models[@]}"; do load+=(--load-model "$model"); done
  refuse_taken_port Triton "$http_port" "$grpc_port"  # else an orphan Triton there would answer `ready`
  LD_LIBRARY_PATH="$libdir:$site/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  PATH="$venv/bin:$PATH" \
    "$site/pytriton/tritonserver/bin/tritonserver" \
      --model-repository "$repo" --backend-directory "$venv/backends" \
      --model-control-mode explicit "${load[@]}" \
      --grpc-address 127.0.0.1 --grpc-port "$grpc_port" \
      --http-address 127.0.0.1 --http-port "$http_port" \
      --allow-metrics false --log-verbose 0 --exit-timeout-secs 5 \
      >"$state/triton.log" 2>&1 &
  echo $! >"$state/triton.pid"
  local deadline=$((SECONDS + 300))  # loading takes ~30 s on 2 idle cores, minutes on busy ones
  while [ "$SECONDS" -lt "$deadline" ]; do
    if ! kill -0 "$(cat "$state/triton.pid")" 2>/dev/null; then  # first: its port, not another's
      echo "triton: the server exited; the end of $state/triton.log:" >&2
      tail -n 30 "$state/triton.log" >&2
      exit 1
    fi
    if ready "$http_port" "${models[@]}"; then return 0; fi
    sleep 0.1
  done
  echo "triton: not ready after 300 s (log: $state/triton.log); stopping it" >&2
  stop "$state"
  exit 1
}

stop() {
  local state file pid
  mkdir -p "$1"; state=$(cd "$1" && pwd); file="$state/triton.pid"
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  # only if that pid is still ours: a pid file left by a crash may name another process by now
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "tritonserver"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

case ${1:-} in
  setup) setup ;;
  start) [ $# -ge 4 ] || { echo "usage: $0 start STATE_DIR GRPC_PORT HTTP_PORT [REPO [MODEL...]]" >&2; exit 2; }
         shift; start "$@" ;;
  stop) [ $# -eq 2 ] || { echo "usage: $0 stop STATE_DIR" >&2; exit 2; }
        stop "$2" ;;
  *) echo "usage: $0 setup | start STATE_DIR GRPC_PORT HTTP_PORT [REPO [MODEL...]] | stop STATE_DIR" >&2; exit 2 ;;
esac

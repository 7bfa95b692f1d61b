#!/usr/bin/env bash
# `make run-triton`: the embedded default with the model served through Triton. Starts the bundled
# tritonserver with triton_models/ (sluice_llm) on 127.0.0.1 (gRPC 18001, HTTP 18000; SLUICE_TRITON_PORTS=G,H
# moves them), writes a copy of the configuration (SLUICE_CONFIG, default sluice.toml) with its [[backends]]
# replaced by infra/triton/backends.toml (mode 600: the file may hold secrets), then runs `make run`'s
# infra/run.sh on it. Stopping run.sh (Ctrl-C) stops Triton too, by pid. One run at a time (a lock on
# .state/run-triton/run.lock): a second one would otherwise stop the first one's Triton when it ends.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source infra/common.sh
state="$root/.state/run-triton"
IFS=, read -r grpc_port http_port <<<"${SLUICE_TRITON_PORTS:-18001,18000}"
mkdir -p "$state"
exec 9>>"$state/run.lock"
flock -n 9 || { echo "another make run-triton is using $state (its lock $state/run.lock is held)" >&2; exit 1; }
trap 'infra/triton/triton.sh stop "$state"' EXIT
trap 'exit 130' INT TERM
.venv/bin/python -m pipeline.triton_repo run-config --config "${SLUICE_CONFIG:-sluice.toml}" --grpc-port "$grpc_port" \
  | private_file "$state/sluice.toml"
infra/triton/triton.sh start "$state" "$grpc_port" "$http_port" 9>&-
echo "Triton on 127.0.0.1:$grpc_port (gRPC), model sluice_llm ready (log: $state/triton.log)"
SLUICE_CONFIG="$state/sluice.toml" bash infra/run.sh 9>&-

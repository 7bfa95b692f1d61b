#!/usr/bin/env bash
# `make run-triton`: the embedded default with the model served through Triton. Starts the bundled
# tritonserver with triton_models/ (sluice_llm) on 127.0.0.1 (gRPC 18001, HTTP 18000; SLUICE_TRITON_PORTS=G,H
# moves them), writes sluice.toml with its [[backends]] replaced by infra/triton/backends.toml, then runs
# `make run`'s infra/run.sh on it. Stopping run.sh (Ctrl-C) stops Triton too, by pid.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
state="$root/.state/run-triton"
IFS=, read -r grpc_port http_port <<<"${SLUICE_TRITON_PORTS:-18001,18000}"
mkdir -p "$state"
trap 'infra/triton/triton.sh stop "$state"' EXIT
trap 'exit 130' INT TERM
.venv/bin/python -m pipeline.triton_repo run-config --grpc-port "$grpc_port" >"$state/sluice.toml"
infra/triton/triton.sh start "$state" "$grpc_port" "$http_port"
echo "Triton on 127.0.0.1:$grpc_port (gRPC), model sluice_llm ready (log: $state/triton.log)"
SLUICE_CONFIG="$state/sluice.toml" bash infra/run.sh

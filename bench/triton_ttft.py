"""Time to first token through Triton (sluice_llm in the bundled tritonserver, over gRPC) against the same
engine in-process (LocalBackend), 32 concurrent streams each, in the same run, interleaved and repeated.

    nice -n 10 .venv/bin/python -m bench.triton_ttft --rounds 4 --streams 32

Starts its own Triton (infra/triton/triton.sh, free ports) and loads the in-process engine with the same
checkpoint, batch size and thread count; only one of the two works at a time. Rounds alternate which goes
first. TTFT is submit to the first delta with text. Every stream must end with exactly one final delta (a
finish reason), or the run fails. Prints p50/p95 per path and their ratio, per round and overall, with the
machine's load average (2 cores shared with other work make single rounds noisy; compare within a round).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.stats import percentile
from pipeline.backends.base import Backend, GenerationRequest, Message
from pipeline.backends.local import LocalBackend
from pipeline.backends.triton import TritonBackend
from pipeline.models import MODEL_DIRNAME

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python.",
    "Explain what a Kafka consumer group is in one sentence.",
    "Write a haiku about the sea.",
    "What does HTTP status 429 mean?",
    "Name two differences between TCP and UDP.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in Python?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one(backend: Backend, request: GenerationRequest) -> tuple[float, int]:
    """TTFT in ms and the number of final deltas of one stream."""
    start = time.perf_counter()
    ttft, finals = None, 0
    async for delta in backend.generate(request):
        if ttft is None and delta.text:
            ttft = (time.perf_counter() - start) * 1000
        finals += delta.finish_reason is not None
    return (ttft if ttft is not None else (time.perf_counter() - start) * 1000), finals


async def _wave(backend: Backend, tag: str, streams: int, max_tokens: int) -> list[float]:
    requests = [
        GenerationRequest(f"{tag}-{i}", messages=(Message("user", PROMPTS[i % len(PROMPTS)] + f" (#{i})"),),
                          max_tokens=max_tokens)
        for i in range(streams)
    ]
    results = await asyncio.gather(*(_one(backend, r) for r in requests))
    bad = [r.request_id for r, (_, finals) in zip(requests, results, strict=True) if finals != 1]
    if bad:
        raise SystemExit(f"{tag}: streams without exactly one final delta: {bad}")
    return [ttft for ttft, _ in results]


async def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = ROOT / ".cache" / "models" / MODEL_DIRNAME
    local = LocalBackend.from_path(model, name="local", max_batch=args.max_batch)
    state = Path(tempfile.mkdtemp(prefix="sluice-triton-bench-"))
    grpc_port, http_port = _free_port(), _free_port()
    script = ROOT / "infra" / "triton" / "triton.sh"
    subprocess.run([script, "start", state, str(grpc_port), str(http_port)], check=True)
    triton = TritonBackend(f"127.0.0.1:{grpc_port}", "sluice_llm", name="triton", timeout_s=300)
    try:
        for backend in (local, triton):  # warm-up, a full wave each: first-call costs are not compared
            await _wave(backend, f"warm-{backend.name}", args.streams, args.max_tokens)
        ratios: list[float] = []
        totals: dict[str, list[float]] = {"local": [], "triton": []}
        print("| round | first | in-process p50 / p95 (ms) | Triton p50 / p95 (ms) | p95 ratio | load (1 min) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for round_ in range(args.rounds):
            order = (local, triton) if round_ % 2 == 0 else (triton, local)
            waves = {b.name: await _wave(b, f"r{round_}-{b.name}", args.streams, args.max_tokens) for b in order}
            for name, values in waves.items():
                totals[name] += values
            lp, tp = (percentile(waves[n], 95) for n in ("local", "triton"))
            ratios.append(tp / lp)
            print(f"| {round_ + 1} | {order[0].name} | {percentile(waves['local'], 50):.0f} / {lp:.0f} | "
                  f"{percentile(waves['triton'], 50):.0f} / {tp:.0f} | {tp / lp:.2f} | {os.getloadavg()[0]:.1f} |")
        lp, tp = (percentile(totals[n], 95) for n in ("local", "triton"))
        print(f"| all ({len(totals['local'])} streams each) | | {percentile(totals['local'], 50):.0f} / {lp:.0f} | "
              f"{percentile(totals['triton'], 50):.0f} / {tp:.0f} | {tp / lp:.2f} | |")
        print(f"\nTriton p95 TTFT / in-process p95 TTFT: median of the rounds {statistics.median(ratios):.2f}, "
              f"pooled {tp / lp:.2f} (target <= 1.2); every stream ended exactly once")
    finally:
        await triton.aclose()
        await local.aclose()
        subprocess.run([script, "stop", state], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32, help="sequences per engine step (sluice_llm's max_batch)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (sluice_llm's torch_threads)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

"""What an engine step costs with torch on 1 or 2 threads, with the cores to itself and beside one
process that keeps a core busy (OpenMP's threads spin at each barrier and wait for a descheduled one).

    .venv/bin/python -m bench.torch_threads [--steps 120] [--rounds 2]

The default model, 4 sequences decoding (`max_num_batched_tokens` 64), the first 10 steps dropped;
each configuration in a fresh process (torch's thread count is set once), configurations interleaved
round by round. Prints p50 / p90 / max step time per configuration and round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from pipeline.settings import Settings

BUSY = "while True: pass"


def steps(threads: int, count: int) -> list[float]:
    import torch

    from pipeline.engine.config import EngineConfig
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.model_runner import ModelRunner
    from pipeline.engine.params import EngineRequest
    from pipeline.models import convert_default_model, load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(convert_default_model(Settings().model_cache))
    engine = LLMEngine(ModelRunner.from_transformers(model, EngineConfig(num_blocks=128, max_num_batched_tokens=64)))
    for i in range(4):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Write a long story number {i}."}], add_generation_prompt=True)
        engine.add_request(EngineRequest(tuple(int(t) for t in ids), count))
    times = []
    while engine.has_unfinished() and len(times) < count:
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times[10:]


def run(threads: int, busy: bool, count: int) -> str:
    spinner = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        out = subprocess.run([sys.executable, "-m", "bench.torch_threads", "--child", str(threads), "--steps", str(count)],
                             capture_output=True, text=True, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # a measuring process: its thread count
    args = parser.parse_args()
    if args.child is not None:
        ms = sorted(t * 1000 for t in steps(args.child, args.steps))
        print(f"{statistics.median(ms):.1f} / {ms[int(len(ms) * 0.9)]:.1f} / {ms[-1]:.1f}")
        return
    print("| round | torch threads | beside a busy process | step p50 / p90 / max ms |\n| --- | --- | --- | --- |")
    for round_ in range(1, args.rounds + 1):
        for busy in (False, True):
            for threads in (2, 1):
                print(f"| {round_} | {threads} | {'yes' if busy else 'no'} | {run(threads, busy, args.steps)} |", flush=True)


if __name__ == "__main__":
    main()

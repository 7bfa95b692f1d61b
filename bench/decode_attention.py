"""A decode step's time with the compiled paged-attention kernel against the torch path (gather the
blocks, masked SDPA), same engine, same model and prompts, at several widths and context lengths.

Each setting builds two engines (kernel on, off) that prefill the same random prompts (a tenant per
sequence, so nothing is shared), then alternate decode steps ABBA; reported: the median step time of
each and the ratio, per repeat, then the median and range over repeats.

    .venv/bin/python -m bench.decode_attention --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.engine_common import abba, add_model_args, load_model, make_engine, ratio_row
from pipeline.engine.config import EngineConfig, ModelConfig
from pipeline.engine.params import EngineRequest

STEPS = 24  # timed decode steps per engine and repeat


def decoding_engine(model, seqs: int, context: int, kernel: bool, seed: int):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    per_token = ModelConfig.from_dict(model.config.to_dict()).kv_bytes_per_token(4)  # a float32 pool on a CPU
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=2048, decode_kernel=kernel,
                          kv_cache_bytes=seqs * (context + 4 * STEPS + 64) * per_token)
    engine = make_engine(model, config)
    for i in range(seqs):
        prompt = tuple(rng.randrange(1000, 40000) for _ in range(context))
        engine.add_request(EngineRequest(prompt, max_tokens=4 * STEPS + 8, salt=f"{seed}-{i}"))
    while len(engine.scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    return engine


def timed_step(engine) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--settings", default="8x350,8x700,32x350,32x700", help="sequences x context tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(args)
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads or 'default'} torch threads")
    print("| sequences x context | kernel step ms | torch-path step ms | torch / kernel |")
    print("| --- | --- | --- | --- |")
    for setting in args.settings.split(","):
        seqs, context = map(int, setting.split("x"))
        ratios, on, off = [], [], []
        for repeat in range(args.repeats):
            a = decoding_engine(model, seqs, context, True, repeat)
            b = decoding_engine(model, seqs, context, False, repeat)
            times = abba(STEPS, lambda kernel: timed_step(a if kernel else b))
            on.append(statistics.median(times[True]))
            off.append(statistics.median(times[False]))
            ratios.append(off[-1] / on[-1])
        print(ratio_row(f"{seqs} x {context}", on, off, ratios), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

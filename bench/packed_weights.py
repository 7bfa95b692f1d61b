"""A forward of N rows with the projection weights packed for oneDNN against `F.linear` (MKL sgemm,
which packs the weights again on every call), same engine, same model, same context.

Two engines (`packed_weights` on, off) each hold one sequence whose random prompt (`--context`
tokens) is already computed; each timed call feeds N tokens after it (`forward_tokens`: every row
scored, as speculative verification does; then truncated back), the two engines alternating ABBA.
Reported per N: the median time of each and the ratio, median and range over repeats.

    .venv/bin/python -m bench.packed_weights --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.engine_common import abba, add_model_args, load_model, make_engine, ratio_row
from pipeline.engine.config import EngineConfig
from pipeline.engine.params import EngineRequest

CALLS = 12  # timed forwards per engine, N and repeat


def engine_with_context(model, packed: bool, context: int, seed: int):  # type: ignore[no-untyped-def]
    engine = make_engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=4096, packed_weights=packed,
                                             kv_cache_bytes=256 << 20))
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(context)]
    seq = engine.scheduler.new_sequence(EngineRequest(tuple(prompt), max_tokens=1024))
    engine.forward_tokens(seq, prompt)
    return engine, seq


def timed_forward(engine, seq, rows: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    engine.forward_tokens(seq, [5] * rows)
    elapsed = time.perf_counter() - start
    engine.truncate(seq, rows)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--rows", default="1,2,4,9,17,32,300", help="tokens per forward")
    parser.add_argument("--context", type=int, default=300, help="tokens already computed before each forward")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(args)
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads or 'default'} torch threads; "
          f"{args.dtype} weights; {args.context} tokens of context")
    print("| rows | packed ms | F.linear ms | F.linear / packed |")
    print("| --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        on, off, ratios = [], [], []
        for repeat in range(args.repeats):
            engines = {packed: engine_with_context(model, packed, args.context, repeat) for packed in (True, False)}
            times = abba(CALLS, lambda packed: timed_forward(*engines[packed], rows))
            on.append(statistics.median(times[True]))
            off.append(statistics.median(times[False]))
            ratios.append(off[-1] / on[-1])
        print(ratio_row(str(rows), on, off, ratios), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

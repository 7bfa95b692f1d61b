"""Prefix caching: time to first token with a shared ~1,000-token system prompt, cached against
uncached, same engine, alternating request by request in one run (which of a pair goes first alternates too).

"Uncached" requests carry a fresh tenant salt each, so no block can be shared (the same code path,
with the cache unable to hit); "cached" requests share one tenant, whose system-prompt blocks a
warm-up request computed. TTFT is from `add_request` to the first sampled token (engine steps only,
no Kafka), one request at a time.

    .venv/bin/python -m bench.prefix_caching [--requests 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

from bench.engine_common import add_model_args, load_model, make_engine, peak_rss_mib, sync
from bench.stats import percentile, row
from pipeline.engine.config import EngineConfig
from pipeline.engine.params import EngineRequest
from pipeline.engine.sequence import SequenceStatus
from pipeline.sharegpt import first_turns


def system_prompt(tokenizer, target_tokens: int) -> str:  # type: ignore[no-untyped-def]
    """Policy-like text built from ShareGPT answers until it reaches about `target_tokens` tokens."""
    text = "You are a support assistant. Follow these notes when you answer:\n"
    for _, answer in first_turns(200):
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= target_tokens:
            break
        text += answer[:400] + "\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:target_tokens]
    return str(tokenizer.decode(ids))


def ttft(engine, prompt: tuple[int, ...], salt: str) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    seq = engine.add_request(EngineRequest(prompt, max_tokens=1, salt=salt), park_after_first=False)
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    sync(engine.config.device)
    return (time.perf_counter() - start) * 1000, seq.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=8, help="requests of each kind")
    parser.add_argument("--system-tokens", type=int, default=1000)
    args = parser.parse_args()
    model, tokenizer = load_model(args)
    if tokenizer is None:
        import random

        rng = random.Random(0)
        system_ids = [rng.randrange(1000, 40000) for _ in range(args.system_tokens)]
        prompts = [tuple(system_ids + [rng.randrange(1000, 40000) for _ in range(24)]) for _ in range(args.requests * 2 + 1)]
    else:
        system = system_prompt(tokenizer, args.system_tokens)
        questions = [q[:200] for q, _ in first_turns(args.requests * 2 + 1)]

        def render(q: str) -> tuple[int, ...]:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            return tuple(int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True))

        prompts = [render(q) for q in questions]
    config = EngineConfig(max_num_batched_tokens=4096, max_num_seqs=8, device=args.device, dtype=args.dtype,
                          kv_cache_bytes=256 << 20)
    engine = make_engine(model, config)
    ttft(engine, prompts[0], salt="warm-up")  # compiles nothing, but touches every code path once
    ttft(engine, prompts[0], salt="shared")  # fills the shared tenant's cache with the system prompt
    load = os.getloadavg()[0]
    cached, uncached, hit_tokens = [], [], []
    for i in range(args.requests):
        pair = [(uncached, prompts[1 + 2 * i], f"cold-{i}"), (cached, prompts[2 + 2 * i], "shared")]
        for times, prompt, salt in pair if i % 2 == 0 else pair[::-1]:  # alternate which goes first: drift hits both
            ms, hits = ttft(engine, prompt, salt)
            times.append(ms)
            if times is cached:
                hit_tokens.append(hits)
    lengths = [len(p) for p in prompts[1:]]
    print(f"prompts {min(lengths)}-{max(lengths)} tokens; cached requests took {min(hit_tokens)}-{max(hit_tokens)} "
          f"tokens from the prefix cache (block size {config.block_size}); device {args.device}, {args.dtype}")
    print("| TTFT | p50 ms | p99 ms | mean ms | n |")
    print("| --- | --- | --- | --- | --- |")
    print(row("uncached (fresh tenant salt)", uncached))
    print(row("cached (shared system prompt)", cached))
    ratio = percentile(uncached, 50) / percentile(cached, 50)  # the p50s the table prints
    print(f"**p50 ratio: {ratio:.1f}x** (target >= 5x)")
    print(f"KV bytes per token: {engine.runner.kv_bytes_per_token}; peak RSS {peak_rss_mib():.0f} MiB; "
          f"{args.threads or 'default'} torch thread(s); load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()

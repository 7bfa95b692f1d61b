"""The engine's prefix cache under churn: its segmented LRU against plain LRU, same model, same
requests, one run.

    .venv/bin/python -m bench.prefix_eviction [--requests 60] [--repeats 3] [--threads 1]

Workload: `--prefixes` shared system prompts of about `--system-tokens` tokens each (text from
ShareGPT answers, a different stretch for each), and requests that are either one of them followed by
a ShareGPT question (`--shared` of them) or a one-off prompt of about `--one-off-tokens` tokens that
no other request shares (a pasted document). The KV pool (`--blocks` of 16 tokens) holds the shared
prompts and a few one-off prompts, not all that passes through it, as on a busy server. Requests run
one at a time, prefill and one sampled token (the part a prefix cache changes), on two engines over the
same weights, one with each eviction, alternating request by request with the same prompt, so the
host's drift falls on both. A repeat draws a new order of requests (seeded).

Reported per repeat: prompt tokens computed (not found in the cache) and prefill time, the ratio
segmented / LRU, and the floor: what a pool that never evicts would compute (the block manager
alone). With plain LRU a shared prompt is evicted whenever enough one-off prompts pass between two of
its uses; the segmented cache takes blocks for new content from blocks never hit first.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.engine_common import add_model_args, load_model, make_engine, sync
from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.params import EngineRequest
from pipeline.engine.sequence import Sequence, SequenceStatus
from pipeline.sharegpt import first_turns


def texts_of(tokenizer, answers: list[str], count: int, tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """`count` token lists of `tokens` tokens each, from consecutive ShareGPT answers (none shared)."""
    out: list[list[int]] = []
    ids: list[int] = []
    for answer in answers:
        ids += tokenizer(answer + "\n", add_special_tokens=False)["input_ids"]
        while len(ids) >= tokens and len(out) < count:
            out.append(ids[:tokens])
            ids = ids[tokens:]
        if len(out) == count:
            return out
    raise ValueError(f"ShareGPT ran out of text for {count} x {tokens} tokens")


def workload(tokenizer, args: argparse.Namespace, seed: int) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    turns = first_turns(4000)
    answers = [a for _, a in turns]
    systems = texts_of(tokenizer, answers[:400], args.prefixes, args.system_tokens)
    rest = answers[400:]
    random.Random(seed).shuffle(rest)  # one-off prompts: other answers, in another order each repeat
    one_offs = texts_of(tokenizer, rest, args.requests, args.one_off_tokens)
    questions = [tokenizer(q[:200], add_special_tokens=False)["input_ids"] for q, _ in turns[seed * args.requests:][: args.requests]]
    prompts = []
    for i in range(args.requests):
        if rng.random() < args.shared:
            prompts.append(tuple(rng.choice(systems) + questions[i]))
        else:
            prompts.append(tuple(one_offs[i]))
    return prompts


def floor(prompts: list[tuple[int, ...]], block_size: int) -> int:
    """Prompt tokens computed if the pool were unbounded (nothing ever evicted): the block manager alone,
    no model, with room for every block of every prompt."""
    bm = BlockManager(sum(len(p) for p in prompts) // block_size + len(prompts), block_size)
    computed = 0
    for n, prompt in enumerate(prompts):
        seq = Sequence.from_request(EngineRequest(prompt, max_tokens=1, salt="tenant"), seq_id=n, arrival=0)
        bm.allocate(seq, len(prompt) - bm.cached_prefix_tokens(seq))
        seq.num_computed_tokens = len(prompt)
        bm.commit(seq)
        bm.deallocate(seq)
        computed += len(prompt) - seq.num_cached_tokens
    return computed


def prefill(engine: LLMEngine, prompt: tuple[int, ...]) -> tuple[int, float]:
    """(prompt tokens computed, seconds) for one request run alone to its first token."""
    start = time.perf_counter()
    seq = engine.add_request(EngineRequest(prompt, max_tokens=1, salt="tenant"), park_after_first=False)
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    sync(engine.config.device)
    return len(prompt) - seq.num_cached_tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--one-off-tokens", type=int, default=500)
    parser.add_argument("--shared", type=float, default=0.6, help="share of requests that start with a shared prompt")
    parser.add_argument("--blocks", type=int, default=120, help="KV pool, in blocks of 16 tokens")
    args = parser.parse_args()
    model, tokenizer = load_model(args)
    if tokenizer is None:
        raise SystemExit("needs the real model's tokenizer (drop --random-weights)")
    config = EngineConfig(num_blocks=args.blocks, max_num_seqs=1, max_num_batched_tokens=4096, device=args.device, dtype=args.dtype)
    print(f"{args.prefixes} shared prompts of {args.system_tokens} tokens ({args.shared:.0%} of requests), one-off prompts "
          f"of {args.one_off_tokens} tokens, {args.requests} requests a repeat, a pool of {args.blocks} blocks of "
          f"{config.block_size} tokens; {args.device}, {args.dtype}, load average {os.getloadavg()[0]:.2f}\n")
    print("| repeat | tokens computed: LRU | segmented | unbounded pool (floor) | segmented / LRU | prefill s: LRU | "
          "segmented | segmented / LRU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    token_ratios, time_ratios = [], []
    for repeat in range(args.repeats):
        engines = {"lru": make_engine(model, config), "segmented": make_engine(model, config)}
        engines["lru"].block_manager.segmented = False
        prefill(engines["lru"], (1, 2, 3))  # one untimed request each: first-call costs
        prefill(engines["segmented"], (1, 2, 3))
        tokens = {name: 0 for name in engines}
        seconds = {name: 0.0 for name in engines}
        prompts = workload(tokenizer, args, seed=repeat)
        for i, prompt in enumerate(prompts):
            order = ("lru", "segmented") if i % 2 == 0 else ("segmented", "lru")
            for name in order:
                computed, took = prefill(engines[name], prompt)
                tokens[name] += computed
                seconds[name] += took
        token_ratios.append(tokens["segmented"] / tokens["lru"])
        time_ratios.append(seconds["segmented"] / seconds["lru"])
        print(f"| {repeat} | {tokens['lru']:,} | {tokens['segmented']:,} | {floor(prompts, config.block_size):,} "
              f"| {token_ratios[-1]:.2f} | {seconds['lru']:.1f} "
              f"| {seconds['segmented']:.1f} | {time_ratios[-1]:.2f} |", flush=True)
    print(f"\nsegmented / LRU, median (min to max) over {args.repeats} repeats: tokens computed "
          f"{statistics.median(token_ratios):.2f} ({min(token_ratios):.2f} to {max(token_ratios):.2f}), prefill time "
          f"{statistics.median(time_ratios):.2f} ({min(time_ratios):.2f} to {max(time_ratios):.2f}); "
          f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

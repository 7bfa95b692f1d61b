"""The engine's weights in bfloat16 against float32 on this CPU: decode speed and how often greedy output changes.

    .venv/bin/python -m bench.engine_dtype                       # 24 ShareGPT prompts, 64 tokens, 3 rounds
    .venv/bin/python -m bench.engine_dtype --prompts 48 --offset 200

Two engines over the default checkpoint in one process (one per dtype, the same EngineConfig otherwise).
Each round runs, for each dtype in alternating order: the prompts one at a time (batch 1), then all of
them together (continuous batching, up to `--batch` at once), greedy, `--max-tokens` each, with the
tokens counted as they are produced (an EOS ends a sequence early in both). Speed: generated tokens per
second of wall time, per round, median (min..max) over rounds. Agreement: for each prompt, whether the
bfloat16 greedy tokens equal the float32 ones, and where they first differ. Quality: the perplexity of
each prompt's ShareGPT answer (its first `--max-tokens` tokens, teacher-forced after the prompt) under
each dtype; greedy outputs of two precisions part ways wherever two tokens score nearly alike, which
says little by itself, while a perplexity that moved would say the model got worse.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from transformers import AutoTokenizer

from bench.engine_common import MODEL_DIR
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine_target import EngineTarget
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.params import EngineRequest
from pipeline.sharegpt import first_turns

DTYPES = ("float32", "bfloat16")


def prompts(tokenizer, n: int, offset: int, max_prompt: int, max_answer: int) -> list[tuple[tuple[int, ...], list[int]]]:  # type: ignore[no-untyped-def]
    """`n` (prompt, answer) pairs: first user turns of ShareGPT from the `offset`-th on, chat-templated, at
    most `max_prompt` tokens, and the first `max_answer` tokens of their answers."""
    out: list[tuple[tuple[int, ...], list[int]]] = []
    for human, gpt in first_turns(offset + n * 20)[offset:]:
        ids = tuple(int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": human}], add_generation_prompt=True))
        answer = [int(t) for t in tokenizer(gpt, add_special_tokens=False)["input_ids"][:max_answer]]
        if human.strip() and len(ids) <= max_prompt and answer:
            out.append((ids, answer))
        if len(out) == n:
            break
    return out


def perplexity(engine: LLMEngine, pairs: list[tuple[tuple[int, ...], list[int]]]) -> float:
    """exp of the mean negative log-likelihood of every answer token, teacher-forced after its prompt."""
    nll, count = 0.0, 0
    for ids, answer in pairs:
        target = EngineTarget(engine)
        try:
            logits = target.forward_tokens([*ids, *answer])[len(ids) - 1 : -1]
        finally:
            target.close()
        nll -= torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(answer)[:, None]).sum().item()
        count += len(answer)
    return math.exp(nll / count)


def run(engine: LLMEngine, batch: list[tuple[int, ...]], max_tokens: int, eos: int) -> tuple[list[list[int]], float]:
    """Greedy completions of `batch` run together, and the seconds it took."""
    start = time.perf_counter()
    outputs = engine.generate([EngineRequest(ids, max_tokens=max_tokens, stop_token_ids=frozenset({eos})) for ids in batch])
    return outputs, time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--offset", type=int, default=0, help="skip this many ShareGPT first turns")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences at once in the batched part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    eos = int(tokenizer.eos_token_id)
    pairs = prompts(tokenizer, args.prompts, args.offset, args.max_prompt, args.max_tokens)
    work = [ids for ids, _ in pairs]
    engines = {d: LLMEngine.from_path(MODEL_DIR, EngineConfig(max_num_seqs=args.batch, dtype=d)) for d in DTYPES}
    speed: dict[tuple[str, str], list[float]] = {(d, part): [] for d in DTYPES for part in ("one at a time", "batched")}
    greedy: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            outputs, seconds = [], 0.0
            for ids in work:
                (out,), s = run(engines[d], [ids], args.max_tokens, eos)
                outputs.append(out)
                seconds += s
            speed[(d, "one at a time")].append(sum(map(len, outputs)) / seconds)
            greedy.setdefault(d, outputs)
            batched, s = run(engines[d], work, args.max_tokens, eos)
            speed[(d, "batched")].append(sum(map(len, batched)) / s)
            print(f"round {r + 1} {d}: one at a time {speed[(d, 'one at a time')][-1]:.1f} tokens/s, "
                  f"batched {speed[(d, 'batched')][-1]:.1f} tokens/s", flush=True)
    print(f"\n{len(work)} prompts (ShareGPT first turns from #{args.offset}), max_tokens {args.max_tokens}, "
          f"greedy, {args.threads} torch threads, {args.rounds} rounds, batched up to {args.batch}\n")
    print("| part | float32 tokens/s | bfloat16 tokens/s | bfloat16 / float32, per round |")
    print("| --- | --- | --- | --- |")
    for part in ("one at a time", "batched"):
        a, b = speed[("float32", part)], speed[("bfloat16", part)]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"| {part} | {statistics.median(a):.1f} ({min(a):.1f}..{max(a):.1f}) | {statistics.median(b):.1f} "
              f"({min(b):.1f}..{max(b):.1f}) | {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) |")
    diffs = [first_difference(a, b) for a, b in zip(greedy["float32"], greedy["bfloat16"])]
    same = sum(d is None for d in diffs)
    where = sorted(d for d in diffs if d is not None)
    print(f"\ngreedy output identical for {same} of {len(work)} prompts; where the others first differ (token index): {where}")
    common = [min(len(a), len(b)) for a, b in zip(greedy["float32"], greedy["bfloat16"])]
    tokens = sum(common)
    agree = sum(n if d is None else d for d, n in zip(diffs, common))
    print(f"tokens before the first difference: {agree} of {tokens} ({100 * agree / max(tokens, 1):.1f}%)")
    answers = sum(len(a) for _, a in pairs)
    print("perplexity of the ShareGPT answers (" + str(answers) + " tokens): "
          + ", ".join(f"{d} {perplexity(engines[d], pairs):.3f}" for d in DTYPES))


if __name__ == "__main__":
    main()

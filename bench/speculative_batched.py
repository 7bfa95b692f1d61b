"""Speculative decoding in the engine's batched decode path: tokens/s with and without n-gram drafts, at
batch 1 and batch 8, on input-grounded prompts (correct, rewrite, reformat or edit a text or code given
in the prompt), side by side in one run.

    nice .venv/bin/python -m bench.speculative_batched [--repeats 3] [--max-tokens 128] [--threads 1]

1. DEV: the five prompts `bench.speculative` was tuned on choose `num_draft_tokens` (each candidate once
   at batch 1 and with all five prompts batched, against plain decoding; the best geometric mean wins).
2. TEST: eight other prompts, never used for tuning, report. Each repeat runs, for batch 1 (the prompts
   one after another) and batch 8 (all at once), plain and speculative decoding in alternating order
   (ABBA across repeats), each on a fresh engine that shares the model's weights (no prefix-cache
   carry-over). Every speculative output must equal the plain one token for token (greedy).

Tokens/s is completion tokens over the wall time of the whole generation (prefill included), median
and range over the repeats; the speedup is the median of the per-repeat ratios (range in brackets).
The decode phase is reported apart as well (DESIGN.md's measure, "decode tokens/s"): the tokens after
each request's first over the wall time outside the steps that fed prompt tokens (timed around
`LLMEngine.execute`; at batch 8 a step that feeds one prompt's last chunk beside other sequences'
decodes counts as prefill).
CPU seconds of the process are reported too: steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from bench.speculative import GROUNDED as DEV_PROMPTS
from bench.speculative import MODEL_CACHE
from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.params import EngineRequest, SpeculativeParams
from pipeline.engine.scheduler import SchedulerOutput
from pipeline.models import convert_default_model, load_model

NOTICE = (
    "Dear residents, the water supply on Elm Street will be interrupted on Tuesday from eight in the morning "
    "until two in the afternoon while the old pipes under the road are replaced. Please fill a few bottles "
    "the evening before. The shop on the corner has agreed to stay open late on Monday for anyone who needs "
    "to buy water. We are sorry for the trouble and thank you for your patience."
)
MINUTES = (
    "The comittee met on thursday. Anna presented the budjet for next year, which is ten percent higher then "
    "this year becuase of the new roof. Peter asked weather the roof could wait one more year. The comittee "
    "decided to get two more quotes before the next meeting and to vote on the budjet then."
)
RECIPE = (
    "Boil a large pot of salted water. Cook the pasta for nine minutes. Meanwhile, fry the garlic in olive oil "
    "until golden, then add the chopped tomatoes and simmer for ten minutes. Drain the pasta, keeping a cup of "
    "the water, and stir it into the sauce with a splash of the water. Serve with grated cheese and basil."
)
CODE_SUM = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item["price"] * item["quantity"]
    total = total + total * tax_rate
    return round(total, 2)'''
CODE_FIND = '''def find_user(users, name):
    for i in range(len(users)):
        if users[i]["name"] == name:
            return users[i]
    return None'''
TEST_PROMPTS = [
    f"Correct the spelling mistakes in these minutes and return the whole corrected text.\n\n{MINUTES}",
    f"Rewrite this notice for a newsletter, keeping every fact and the order of the sentences.\n\n{NOTICE}",
    f"Put each step of this recipe on its own numbered line, keeping the wording.\n\n{RECIPE}",
    "Rename the variable `total` to `amount` in this function and return the complete function.\n\n"
    f"{CODE_SUM}",
    f"Add a docstring to this function and return the complete function.\n\n{CODE_FIND}",
    f"Rewrite this notice in the past tense, as a report of what happened.\n\n{NOTICE}",
    f"Copy this recipe, replacing 'pasta' with 'spaghetti' everywhere.\n\n{RECIPE}",
    "This function should skip items whose quantity is negative. Fix it and return the complete function.\n\n"
    f"{CODE_SUM}",
]


@dataclass
class Run:
    wall_s: float
    cpu_s: float
    tokens: int
    steps: int
    proposed: int
    accepted: int
    outputs: list[list[int]]
    prefill_s: float  # wall time of the steps that fed prompt tokens (each prompt's first token is sampled there)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each request's first over the time outside prefill steps: the decode phase, which
        is all speculation can shorten (DESIGN.md's "decode tokens/s")."""
        return (self.tokens - len(self.outputs)) / (self.wall_s - self.prefill_s)


@dataclass
class Cell:
    """One (set, batch) pair: the runs of each mode, in the order they ran."""

    plain: list[Run] = field(default_factory=list)
    spec: list[Run] = field(default_factory=list)


DTYPE = ["float32"]  # the engine's weights (--dtype)


def generate(model: torch.nn.Module, requests: list[EngineRequest], batch: int) -> Run:
    """`requests` `batch` at a time on a fresh engine (the model's weights shared, or cast to --dtype)."""
    config = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=max(batch, 1), max_num_batched_tokens=512, dtype=DTYPE[0])
    engine = LLMEngine(ModelRunner.from_transformers(model, config))
    prefill_s = 0.0
    execute = engine.execute

    def timed(output: SchedulerOutput) -> list[int | None]:
        nonlocal prefill_s
        start = time.perf_counter()
        try:
            return execute(output)
        finally:
            if any(c.start < c.seq.num_prompt_tokens for c in output.chunks):
                prefill_s += time.perf_counter() - start

    engine.execute = timed  # type: ignore[method-assign]
    outputs: list[list[int]] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(requests), batch):
        outputs += engine.generate(requests[first : first + batch])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = engine.scheduler
    return Run(wall, cpu, sum(map(len, outputs)), s.step_count, s.spec_proposed, s.spec_accepted, outputs, prefill_s)


def requests_for(tokenizer, prompts: list[str], max_tokens: int, k: int | None) -> list[EngineRequest]:  # type: ignore[no-untyped-def]
    stop = frozenset({int(tokenizer.convert_tokens_to_ids("<|im_end|>")), int(tokenizer.eos_token_id)})
    spec = SpeculativeParams(num_draft_tokens=k) if k else None
    out = []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(EngineRequest(tuple(int(t) for t in ids), max_tokens=max_tokens, stop_token_ids=stop, speculative=spec))
    return out


def same(cell: Cell) -> str:
    """The table's word on whether speculative output equalled plain greedy in every repeat."""
    differ = sum(a != b for p, s in zip(cell.plain, cell.spec, strict=True) for a, b in zip(p.outputs, s.outputs, strict=True))
    tokens = cell.spec[-1].tokens
    return f"yes ({tokens} tokens)" if not differ else f"no: {differ} of {len(cell.spec) * len(cell.spec[-1].outputs)} outputs differ"


def check_identical(plain: Run, spec: Run, label: str) -> None:
    if plain.outputs != spec.outputs:
        bad = [i for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs, strict=True)) if a != b]
        if DTYPE[0] == "float32":
            raise AssertionError(f"{label}: speculative output differs from plain greedy for prompts {bad}")
        # in bfloat16 a forward over k+1 positions and one over a single position round differently, so
        # a near-tie can go either way: said, not raised
        print(f"{label}: speculative output differs from plain greedy ({DTYPE[0]}) for prompts {bad}", flush=True)


def tune(model, tokenizer, candidates: list[int], max_tokens: int) -> int:  # type: ignore[no-untyped-def]
    print("\n### DEV: choosing num_draft_tokens\n")
    print("| num_draft_tokens | batch 1 speedup | batch 5 speedup | geometric mean | acceptance |")
    print("| --- | --- | --- | --- | --- |")
    plain_reqs = requests_for(tokenizer, DEV_PROMPTS, max_tokens, None)
    plain = {b: generate(model, plain_reqs, b) for b in (1, len(DEV_PROMPTS))}
    best, best_score = candidates[0], 0.0
    for k in candidates:
        spec_reqs = [replace(r, speculative=SpeculativeParams(k)) for r in plain_reqs]
        ratios, accepted, proposed = [], 0, 0
        for b in (1, len(DEV_PROMPTS)):
            spec = generate(model, spec_reqs, b)
            check_identical(plain[b], spec, f"DEV k={k} batch {b}")
            ratios.append(spec.tok_s / plain[b].tok_s)
            accepted, proposed = accepted + spec.accepted, proposed + spec.proposed
        score = statistics.geometric_mean(ratios)
        print(f"| {k} | {ratios[0]:.2f}x | {ratios[1]:.2f}x | {score:.2f}x | {accepted / max(proposed, 1):.2f} |")
        if score > best_score:
            best, best_score = k, score
    print(f"\nchosen: num_draft_tokens = {best}")
    return best


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(cells: dict[int, Cell], k: int) -> None:
    print(f"\n### TEST: {len(TEST_PROMPTS)} prompts, num_draft_tokens = {k}\n")
    print(
        "| batch | plain tok/s | speculative tok/s | speedup (wall) | speedup (CPU) | decode phase: plain / spec tok/s "
        "| decode speedup | acceptance | steps plain / spec | identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch, cell in cells.items():
        wall = [s.tok_s / p.tok_s for p, s in zip(cell.plain, cell.spec, strict=True)]
        cpu = [p.cpu_s / s.cpu_s for p, s in zip(cell.plain, cell.spec, strict=True)]
        decode = [s.decode_tok_s / p.decode_tok_s for p, s in zip(cell.plain, cell.spec, strict=True)]
        spec = cell.spec[-1]
        print(
            f"| {batch} | {spread([r.tok_s for r in cell.plain])} | {spread([r.tok_s for r in cell.spec])} "
            f"| **{spread(wall, '{:.2f}')}x** | {spread(cpu, '{:.2f}')}x "
            f"| {spread([r.decode_tok_s for r in cell.plain])} / {spread([r.decode_tok_s for r in cell.spec])} "
            f"| **{spread(decode, '{:.2f}')}x** | {spec.accepted / max(spec.proposed, 1):.2f} "
            f"| {cell.plain[-1].steps} / {spec.steps} | {same(cell)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dev-max-tokens", type=int, default=96)
    parser.add_argument("--candidates", default="4,8,12", help="num_draft_tokens values DEV chooses from")
    parser.add_argument("--k", type=int, default=0, help="skip DEV and use this num_draft_tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: see bench.speculative's note)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine's weights")
    args = parser.parse_args()
    DTYPE[0] = args.dtype
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(convert_default_model(MODEL_CACHE))
    generate(model, requests_for(tokenizer, TEST_PROMPTS[:2], 8, 4), 2)  # warm-up
    print(f"{args.dtype} weights, {args.threads} torch thread(s); load average at start {os.getloadavg()[0]:.2f}", flush=True)
    k = args.k or tune(model, tokenizer, [int(c) for c in args.candidates.split(",")], args.dev_max_tokens)
    plain_reqs = requests_for(tokenizer, TEST_PROMPTS, args.max_tokens, None)
    spec_reqs = [replace(r, speculative=SpeculativeParams(k)) for r in plain_reqs]
    cells = {1: Cell(), len(TEST_PROMPTS): Cell()}
    for repeat in range(args.repeats):
        for batch, cell in cells.items():
            order = [("plain", plain_reqs), ("spec", spec_reqs)]
            for mode, reqs in order if repeat % 2 == 0 else order[::-1]:
                run = generate(model, reqs, batch)
                getattr(cell, mode).append(run)
                print(f"repeat {repeat + 1} batch {batch} {mode}: {run.tok_s:.1f} tok/s, {run.tokens} tokens "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
            check_identical(cell.plain[-1], cell.spec[-1], f"TEST batch {batch} repeat {repeat + 1}")
    report(cells, k)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

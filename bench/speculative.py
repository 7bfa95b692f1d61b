"""Speculative decoding at batch 1: decode tokens/s with and without speculation, side by side in one run.

    .venv/bin/python -m bench.speculative                      # both parts
    .venv/bin/python -m bench.speculative --part ngram         # SmolLM2-135M + n-gram prompt lookup
    .venv/bin/python -m bench.speculative --part draft --draft-tokens 24

(a) n-gram: SmolLM2-135M-Instruct rewrites, corrects or annotates a text that is in its prompt (an
    input-grounded workload), with and without `NGramProposer`. Target: >= 2x.
(b) draft model: Qwen2.5-Coder-1.5B-Instruct answers chat prompts, with and without the 0.5B model of the
    same family drafting (`DraftModelProposer`). Reported as measured, with the acceptance rate.

Each prompt runs plain, then speculative, alternately `--repeats` times (after one warm-up); every output
must be identical token for token (greedy), and each mode keeps its best run. Decode speed counts the
tokens after the first (the first comes from the prefill, the same in both) over the time after the
prefill, in this process's CPU time (the headline: on one thread it is what the wall clock shows on an
idle core) and in wall time (noisy while other work shares the cores). Torch runs on one thread by
default: on a shared 2-core machine, two-thread GEMMs stall at their barriers whenever a core is taken,
which hits the multi-token verification forward hardest.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.engine.qwen_pair import DRAFT, TARGET, convert_pair_model, load_pair_model
from pipeline.engine.speculative import (
    AdaptiveDraftLength,
    DraftModelProposer,
    HuggingFaceModel,
    NGramProposer,
    Proposer,
    SpeculativeDecoder,
    TargetModel,
)
from pipeline.models import convert_default_model, load_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODEL_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "models"

PARAGRAPH = (
    "The Sluice river rises in the northern hills and flows south for forty kilometres before it reaches the sea. "
    "Along the way it passes three villages, an old water mill and a small harbour where the fishing boats shelter "
    "in winter. In spring the water runs high and fast; in late summer it is slow and clear enough to see the "
    "stones on its bed. The harbour master opens the lock gate at six every morning, and the boats leave in the "
    "order in which they arrived."
)
TYPOS = (
    "Our team meets evry Monday at nine to plan the week. Each person says what they finished last week, "
    "what they will work on next, and what is blocking them. The meeting should not last more then fifteen "
    "minutes; longer discusions move to a seperate call with only the people who need to be there."
)
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages'''
GROUNDED = [
    f"Correct the spelling mistakes in this text and return the whole corrected text.\n\n{TYPOS}",
    f"Rewrite the following paragraph, keeping every fact and the order of the sentences.\n\n{PARAGRAPH}",
    f"Put each sentence of this text on its own line.\n\n{PARAGRAPH}",
    f"Summarise this text in three sentences, reusing its own words.\n\n{PARAGRAPH}",
    "This function should also accept a window equal to zero and return an empty list. "
    f"Fix it and return the complete function.\n\n{CODE}",
]
# The n-gram proposer costs microseconds and a verification forward costs about the same for 2 or 16
# tokens, so its drafts are long; a draft model pays a forward per draft token, so its k adapts lower.
# A rejected n-gram draft costs only its share of the verification forward, so k may keep growing at a
# lower acceptance rate than the defaults (0.7 / 0.4), which are meant for a draft model.
NGRAM_K: dict[str, Any] = {"k": 8, "min_k": 2, "max_k": 16, "raise_above": 0.5, "lower_below": 0.2}
DRAFT_K: dict[str, Any] = {"k": 3, "min_k": 1, "max_k": 8}
CHAT = [
    "How do I reverse a list in Python?",
    "Write a SQL query that counts orders per customer.",
    "What is the difference between a process and a thread?",
]


class TimedProposer:
    """A proposer that adds up the CPU seconds its proposals take (greedy runs call `propose` only)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.cpu_s = 0.0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        started = time.process_time()
        try:
            return self.inner.propose(token_ids, k)
        finally:
            self.cpu_s += time.process_time() - started


@dataclass
class Row:
    """One prompt (or the sum over prompts): each mode's best (least disturbed) of its repeats."""

    tokens: int = 0  # decode tokens (after the first), the same in both modes
    plain_cpu_s: float = 0.0
    spec_cpu_s: float = 0.0
    plain_s: float = 0.0  # wall clock
    spec_s: float = 0.0
    proposer_cpu_s: float = 0.0  # of the best speculative run
    steps: int = 0
    proposed: int = 0
    accepted: int = 0

    def add(self, other: Row) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def cells(self) -> str:
        return (
            f"{self.tokens} | {self.tokens / self.plain_cpu_s:.2f} | {self.tokens / self.spec_cpu_s:.2f} "
            f"| **{self.plain_cpu_s / self.spec_cpu_s:.2f}x** | {self.plain_s / self.spec_s:.2f}x "
            f"| {self.accepted / max(self.proposed, 1):.2f} | {self.tokens / max(self.steps, 1):.2f} "
            f"| {self.proposer_cpu_s / self.spec_cpu_s:.0%} |"
        )


def measure(
    target: TargetModel, proposer: Proposer, ids: list[int], max_tokens: int, stop: int, k: dict[str, Any], repeats: int
) -> Row:
    """Plain greedy decoding, then speculative, `repeats` times alternately; outputs must be identical."""
    plain_runs, spec_runs = [], []
    for _ in range(repeats):
        plain_runs.append(SpeculativeDecoder(target, None).generate(ids, max_tokens, [stop]))
        timed = TimedProposer(proposer)
        spec = SpeculativeDecoder(target, timed, draft_length=AdaptiveDraftLength(**k)).generate(ids, max_tokens, [stop])
        spec_runs.append((spec, timed.cpu_s))
        if spec.tokens != plain_runs[0].tokens or plain_runs[-1].tokens != plain_runs[0].tokens:
            raise AssertionError(f"speculative output differs from plain greedy:\n{spec.tokens}\n{plain_runs[0].tokens}")
    spec, proposer_cpu_s = min(spec_runs, key=lambda run: run[0].stats.decode_cpu_s)
    return Row(
        tokens=len(spec.tokens) - 1,
        plain_cpu_s=min(p.stats.decode_cpu_s for p in plain_runs),
        spec_cpu_s=spec.stats.decode_cpu_s,
        plain_s=min(p.stats.decode_s for p in plain_runs),
        spec_s=min(s.stats.decode_s for s, _ in spec_runs),
        proposer_cpu_s=proposer_cpu_s,
        steps=spec.stats.steps,
        proposed=spec.stats.proposed,
        accepted=spec.stats.accepted,
    )


def forward_costs(target: TargetModel, context: list[int], lengths: tuple[int, ...] = (1, 2, 5, 9, 17)) -> str:
    """CPU ms of one target forward of n tokens after `context` (best of 3): what a verification costs."""
    target.truncate(0)
    target.forward_tokens(context)
    cells = []
    for n in lengths:
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            target.forward_tokens(context[:n])
            best = min(best, time.process_time() - started)
            target.truncate(len(context))
        cells.append(f"{n}: {best * 1000:.0f} ms")
    return ", ".join(cells)


def run_part(
    title: str,
    target: TargetModel,
    tokenizer: PreTrainedTokenizerBase,
    proposer: Proposer,
    prompts: list[str],
    max_tokens: int,
    k: dict[str, Any],
    repeats: int,
) -> Row:
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chats = [[{"role": "user", "content": p}] for p in prompts]
    encoded = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    measure(target, proposer, encoded[0], 8, stop, k, 1)  # warm-up
    print(f"\n### {title}\n")
    print(f"best of {repeats} alternating runs per mode; draft length {k}")
    print(f"target forward CPU time by tokens fed: {forward_costs(target, encoded[0])}\n")
    print(
        "| prompt | prompt tokens | decode tokens | plain tok/CPU-s | speculative tok/CPU-s | speedup (CPU time) "
        "| speedup (wall) | acceptance | tokens per target forward | CPU in proposer |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    total = Row()
    for text, ids in zip(prompts, encoded, strict=True):
        row = measure(target, proposer, ids, max_tokens, stop, k, repeats)
        print(f"| {text.split(chr(10))[0][:52]} | {len(ids)} | {row.cells()}", flush=True)
        total.add(row)
    print(f"| **all** | | {total.cells()}")
    print(
        f"\nspeedup over all prompts: {total.plain_cpu_s / total.spec_cpu_s:.2f}x in CPU time, "
        f"{total.plain_s / total.spec_s:.2f}x in wall time; outputs identical to plain greedy: yes (asserted)"
    )
    return total


def ngram_part(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(convert_default_model(MODEL_CACHE))
    proposer = NGramProposer(max_n=args.max_n, min_n=args.min_n)
    run_part(
        f"(a) n-gram prompt lookup, SmolLM2-135M-Instruct, {args.tokens} new tokens at most per prompt",
        HuggingFaceModel(model), tokenizer, proposer, GROUNDED, args.tokens, NGRAM_K, args.repeats,
    )


def draft_part(args: argparse.Namespace) -> None:
    target_model, tokenizer = load_pair_model(convert_pair_model(MODEL_CACHE, TARGET.name))
    draft_model, _ = load_pair_model(convert_pair_model(MODEL_CACHE, DRAFT.name))
    target, draft = HuggingFaceModel(target_model), HuggingFaceModel(draft_model)
    run_part(
        f"(b) draft model: Qwen2.5-Coder-0.5B-Instruct drafting for 1.5B-Instruct, {args.draft_tokens} new tokens at most",
        target, tokenizer, DraftModelProposer(draft), CHAT, args.draft_tokens, DRAFT_K, args.draft_repeats,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["ngram", "draft", "all"], default="all")
    parser.add_argument("--tokens", type=int, default=160, help="new tokens at most per prompt, n-gram part")
    parser.add_argument("--draft-tokens", type=int, default=32, help="new tokens at most per prompt, draft part")
    parser.add_argument("--max-n", type=int, default=3)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per mode and prompt, n-gram part")
    parser.add_argument("--draft-repeats", type=int, default=2, help="the same, draft part")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the module docstring)")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is first imported (see pipeline.models)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, batch 1, greedy")
    if args.part in ("ngram", "all"):
        ngram_part(args)
    if args.part in ("draft", "all"):
        draft_part(args)


if __name__ == "__main__":
    main()

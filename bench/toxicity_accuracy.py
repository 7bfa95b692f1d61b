"""Toxicity beyond a profanity list: the configured scorer on threats and insults written without
profanity, on profane abuse, and on benign sentences with violent or rude words in them.

    .venv/bin/python -m bench.toxicity_accuracy [--backends profanity_check,minilm] [--answers 300]

`bench/data/toxicity_labelled.jsonl` holds 50 sentences written for this check (kind: threat, insult,
profane, benign). Prints, at the `[guard] toxicity_threshold` (0.8) and at 0.5, the share of each kind
that each scorer would flag (alt-profanity-check, and the MiniLM head with it: train_toxicity.py), so a
miss on threats is visible rather than hidden in an average.

`--answers N` also streams ShareGPT first answers 0..N-1 (the head's test answers) word by word through
the output guard at the default holdback and counts those ended for toxicity (minutes). This is what
serving does, and it ends more than scoring whole sentences does: a sentence longer than the window is
scored on every chunk once its start is about to be released, so its beginnings are scored too.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

from pipeline.guard.config import GuardSettings
from pipeline.guard.errors import Reason
from pipeline.guard.loader import output_guard, toxicity_scorer
from pipeline.guard.stream_check import StreamState
from pipeline.settings import Settings
from pipeline.sharegpt import first_turns

DATA = Path(__file__).resolve().parent / "data" / "toxicity_labelled.jsonl"


def streamed_answers_ended(backend: str, answers: list[str]) -> int:
    settings = GuardSettings(toxicity_backend=backend)  # type: ignore[arg-type]
    guard = output_guard(settings, Settings().model_cache)
    ended = 0
    for answer in answers:
        state = StreamState(policy=settings.policy("default"))
        steps = (guard.push(state, chunk) for chunk in re.findall(r"\S+\s*", answer))
        step = next((s for s in steps if s.violation), None) or guard.finish(state)
        ended += step.violation == Reason.toxicity
    return ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="profanity_check,minilm", help="comma-separated toxicity backends to compare")
    parser.add_argument("--answers", type=int, default=0, help="also stream this many ShareGPT answers through the output guard")
    args = parser.parse_args()
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    for backend in args.backends.split(","):
        settings = GuardSettings(toxicity_backend=backend)  # type: ignore[arg-type]
        scorer = toxicity_scorer(settings, Settings().model_cache)
        started = time.perf_counter()
        scores = scorer.scores([r["text"] for r in rows])
        per_sentence_ms = (time.perf_counter() - started) * 1000 / len(rows)
        by_kind: dict[str, list[float]] = defaultdict(list)
        for r, s in zip(rows, scores, strict=True):
            by_kind[r["kind"]].append(s)
        print(f"\nscorer {backend}, {len(rows)} sentences, {per_sentence_ms:.1f} ms a sentence")
        print(f"| kind | n | flagged at {settings.toxicity_threshold} | flagged at 0.5 |\n| --- | --- | --- | --- |")
        for kind, values in by_kind.items():
            at = lambda t: sum(v >= t for v in values) / len(values)  # noqa: E731
            print(f"| {kind} | {len(values)} | {at(settings.toxicity_threshold):.2f} | {at(0.5):.2f} |")
        if args.answers:
            answers = [a for _, a in first_turns(args.answers)]
            ended = streamed_answers_ended(backend, answers)
            print(f"streamed ShareGPT answers 0..{len(answers) - 1}: {ended} ended for toxicity ({ended / len(answers):.1%})")


if __name__ == "__main__":
    main()

"""Toxicity beyond a profanity list: the configured scorer on threats and insults written without
profanity, on profane abuse, and on benign sentences with violent or rude words in them.

    .venv/bin/python -m bench.toxicity_accuracy [--backends profanity_check,minilm]

`bench/data/toxicity_labelled.jsonl` holds 50 sentences written for this check (kind: threat, insult,
profane, benign). Prints, at the `[guard] toxicity_threshold` (0.8) and at 0.5, the share of each kind
that each scorer would flag (alt-profanity-check, and the MiniLM head with it: train_toxicity.py), so a
miss on threats is visible rather than hidden in an average.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import toxicity_scorer
from pipeline.settings import Settings

DATA = Path(__file__).resolve().parent / "data" / "toxicity_labelled.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="profanity_check,minilm", help="comma-separated toxicity backends to compare")
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


if __name__ == "__main__":
    main()

"""Toxicity beyond a profanity list: the configured scorer on threats and insults written without
profanity, on profane abuse, and on benign sentences with violent or rude words in them.

    .venv/bin/python -m bench.toxicity_accuracy

`bench/data/toxicity_labelled.jsonl` holds 50 sentences written for this check (kind: threat, insult,
profane, benign). Prints, at the `[guard] toxicity_threshold` (0.8) and at 0.5, the share of each kind
that postguard's scorer would flag, so a miss on threats is visible rather than hidden in an average.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import toxicity_scorer

DATA = Path(__file__).resolve().parent / "data" / "toxicity_labelled.jsonl"


def main() -> None:
    settings = GuardSettings()
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    scores = toxicity_scorer(settings).scores([r["text"] for r in rows])
    by_kind: dict[str, list[float]] = defaultdict(list)
    for r, s in zip(rows, scores, strict=True):
        by_kind[r["kind"]].append(s)
    print(f"scorer {settings.toxicity_backend}, {len(rows)} sentences")
    print(f"| kind | n | flagged at {settings.toxicity_threshold} | flagged at 0.5 |\n| --- | --- | --- | --- |")
    for kind, values in by_kind.items():
        at = lambda t: sum(v >= t for v in values) / len(values)  # noqa: E731
        print(f"| {kind} | {len(values)} | {at(settings.toxicity_threshold):.2f} | {at(0.5):.2f} |")


if __name__ == "__main__":
    main()

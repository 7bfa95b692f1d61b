"""Applies a per-entity policy to findings: allow (leave the text), redact (a typed placeholder such
as `<EMAIL_1>`; the same value keeps the same placeholder within a request), or block."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.guard.entities import DEFAULT_POLICY, Action
from pipeline.guard.pii import Finding


@dataclass(frozen=True)
class Redacted:
    text: str
    blocked: tuple[str, ...]  # entities found whose action is block (the text is then not to be sent)
    redacted: int  # spans replaced by placeholders


class Placeholders:
    """Numbers placeholders per entity for one request: `<EMAIL_1>`, `<EMAIL_2>`, ..."""

    def __init__(self) -> None:
        self._by_value: dict[tuple[str, str], str] = {}
        self._count: Counter[str] = Counter()

    def __call__(self, entity: str, value: str) -> str:
        key = (entity, value)
        if key not in self._by_value:
            self._count[entity] += 1
            self._by_value[key] = f"<{entity}_{self._count[entity]}>"
        return self._by_value[key]


def without_overlaps(findings: list[Finding]) -> list[Finding]:
    """Where spans overlap, the highest score wins, then the longest span; result in text order."""
    kept: list[Finding] = []
    for f in sorted(findings, key=lambda f: (-f.score, -(f.end - f.start), f.start)):
        if all(f.end <= k.start or f.start >= k.end for k in kept):
            kept.append(f)
    return sorted(kept, key=lambda f: f.start)


def apply_policy(text: str, findings: list[Finding], policy: Mapping[str, Action], placeholders: Placeholders) -> Redacted:
    parts: list[str] = []
    blocked: list[str] = []
    at = redacted = 0
    for f in without_overlaps(findings):
        action = policy.get(f.entity, DEFAULT_POLICY.get(f.entity, "redact"))
        if action == "block":
            blocked.append(f.entity)
        elif action == "redact":
            parts += [text[at : f.start], placeholders(f.entity, text[f.start : f.end])]
            at = f.end
            redacted += 1
    parts.append(text[at:])
    return Redacted("".join(parts), tuple(dict.fromkeys(blocked)), redacted)

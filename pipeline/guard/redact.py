"""Applies a per-entity policy to findings: allow (leave the text), redact (a typed placeholder such
as `<EMAIL_1>`; the same value keeps the same placeholder within a request), or block."""

from __future__ import annotations

import hashlib
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
    """Numbers placeholders per entity for one request: `<EMAIL_1>`, `<EMAIL_2>`, ... Values are kept
    only as SHA-256 digests, so the table can be stored (postguard's state) without the PII itself."""

    def __init__(self, known: dict[str, str] | None = None) -> None:
        self._by_value: dict[str, str] = dict(known or {})  # sha256(entity, value) -> placeholder
        self._count: Counter[str] = Counter(p[1:].rsplit("_", 1)[0] for p in self._by_value.values())

    def __call__(self, entity: str, value: str) -> str:
        key = hashlib.sha256(f"{entity}\0{value}".encode()).hexdigest()
        if key not in self._by_value:
            self._count[entity] += 1
            self._by_value[key] = f"<{entity}_{self._count[entity]}>"
        return self._by_value[key]

    def known(self) -> dict[str, str]:
        """The table as it can be stored: digests to placeholders."""
        return dict(self._by_value)


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

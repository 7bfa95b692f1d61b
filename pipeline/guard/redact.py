"""Applies a per-entity policy to findings: allow (leave the text), redact (a typed placeholder such
as `<EMAIL_1>`; the same value keeps the same placeholder within a request, however it was written:
full-width or with zero-width characters in it), or block."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.guard.entities import DEFAULT_POLICY, Action
from pipeline.guard.normalise import normalise
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


def merged(findings: list[Finding]) -> list[tuple[int, int, str]]:
    """Overlapping findings as one span each (start, end, entity): the union of the cluster, named for
    its highest-scoring finding (then the longest). Keeping only the winner of an overlap left the
    loser's part in the clear ("4111 1111 1111 1111.jane@example.org": the card's digits before the
    e-mail's placeholder); in text order."""
    spans: list[tuple[int, int, str]] = []
    best: Finding | None = None
    for f in sorted(findings, key=lambda f: (f.start, -f.end)):
        if spans and f.start < spans[-1][1]:
            start, end, _ = spans[-1]
            assert best is not None
            best = max(best, f, key=lambda g: (g.score, g.end - g.start))
            spans[-1] = (start, max(end, f.end), best.entity)
        else:
            best = f
            spans.append((f.start, f.end, f.entity))
    return spans


def apply_policy(text: str, findings: list[Finding], policy: Mapping[str, Action], placeholders: Placeholders) -> Redacted:
    """Every finding counts, overlapping or not: a `block` one blocks (an allowed finding over it, or a
    longer one of another entity, no longer hides it), the `redact` ones are replaced, merged where
    they overlap; `allow` ones are left as they are. A placeholder replaces the finding's whole span of
    `text` (pii.py maps findings back to the text as written), and is numbered by the value as the
    recognisers read it, so "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ" and "john@example.com" are one address."""
    actions = [(f, policy.get(f.entity, DEFAULT_POLICY.get(f.entity, "redact"))) for f in sorted(findings, key=lambda f: f.start)]
    blocked = tuple(dict.fromkeys(f.entity for f, action in actions if action == "block"))
    parts: list[str] = []
    at = redacted = 0
    for start, end, entity in merged([f for f, action in actions if action == "redact"]):
        parts += [text[at:start], placeholders(entity, normalise(text[start:end]).text)]
        at = end
        redacted += 1
    parts.append(text[at:])
    return Redacted("".join(parts), blocked, redacted)

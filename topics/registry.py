"""Every topic sluice uses: name, partitions, config, and the message type it carries.

Only topics with a schema and a stage that uses them are declared; `llm.cache.entries` and
`llm.backend.health` (DESIGN.md) arrive with the cache and routing issues.

Reply topics are `llm.responses.<name>`, one per configured tenant or bridge; `reply_topic()` builds
the name and `is_reply_topic()` is what ingest checks a request's `reply_to` against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DAY_MS = 24 * 3600 * 1000

REQUESTS = "llm.requests"
ADMITTED = "llm.admitted"
GUARDED = "llm.guarded"  # guard -> route: the sanitised request
PREFILLED = "llm.prefilled"
TOKENS = "llm.tokens"
CHECKED = "llm.checked"  # postguard -> emit: the stream after the output checks
CONTROL = "llm.control"
DLQ = "llm.dlq"
USAGE = "llm.usage"
ROUTED_PREFIX = "llm.routed."
REPLY_PREFIX = "llm.responses."

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    carries: str  # the message types, by schema tag
    config: dict[str, str] = field(default_factory=dict)


def routed_topic(pool: str) -> str:
    if not _NAME.match(pool):
        raise ValueError(f"invalid pool name {pool!r}")
    return ROUTED_PREFIX + pool


def reply_topic(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"invalid reply topic name {name!r}")
    return REPLY_PREFIX + name


def is_reply_topic(topic: str) -> bool:
    return topic.startswith(REPLY_PREFIX) and bool(_NAME.match(topic[len(REPLY_PREFIX) :]))


def all_topics(*, pools: tuple[str, ...], replies: tuple[str, ...], partitions: int) -> list[TopicSpec]:
    """The topics for a deployment with these backend pools and reply topic names."""
    day = {"retention.ms": str(DAY_MS)}
    hour = {"retention.ms": str(3600 * 1000)}
    specs = [
        TopicSpec(REQUESTS, partitions, "request.v1", day),
        TopicSpec(ADMITTED, partitions, "envelope.v1", hour),
        TopicSpec(GUARDED, partitions, "envelope.v1", hour),
        TopicSpec(PREFILLED, partitions, "envelope.v1", hour),
        TopicSpec(TOKENS, partitions, "chunk.v1 | done.v1 | error.v1", hour),
        TopicSpec(CHECKED, partitions, "chunk.v1 | done.v1 | error.v1", hour),
        TopicSpec(CONTROL, partitions, "cancel.v1", hour),
        TopicSpec(DLQ, 1, "dead_letter.v1", {"retention.ms": str(7 * DAY_MS)}),
        TopicSpec(USAGE, partitions, "usage.v1", {"retention.ms": str(30 * DAY_MS)}),
    ]
    specs += [TopicSpec(routed_topic(p), partitions, "envelope.v1", hour) for p in pools]
    specs += [TopicSpec(reply_topic(r), partitions, "chunk.v1 | done.v1 | error.v1", hour) for r in replies]
    return specs

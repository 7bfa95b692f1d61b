"""Every topic sluice uses: name, partitions, config, and the message type it carries.

Only topics with a schema and a stage that uses them are declared. Which stage reads and
writes which topic is `pipeline.topology`'s business, not this module's.

Reply topics are `llm.responses.<name>`, one per configured tenant or bridge; `reply_topic()` builds
the name and `is_reply_topic()` is what ingest checks a request's `reply_to` against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DAY_MS = 24 * 3600 * 1000

REQUESTS = "llm.requests"
ADMITTED = "llm.admitted"
SCREENED = "llm.screened"  # guard -> cache: the sanitised request
GUARDED = "llm.guarded"  # -> route: the request to generate (the cache's misses, or guard's output without a cache)
CACHE_ENTRIES = "llm.cache.entries"  # compacted: emit -> every cache worker (topics.cache)
HEALTH = "llm.backend.health"  # compacted: generation workers -> every route worker (topics.health)
TOKENS = "llm.tokens"
CHECKED = "llm.checked"  # postguard -> emit: the stream after the output checks
CONTROL = "llm.control"
DLQ = "llm.dlq"
USAGE = "llm.usage"
# Records no request waits for: the stages' processes send them through a producer that lingers to batch
# them (`kafka.lingering_ms`, pipeline/producing.py). Not health: a generation worker's report at the
# failure streak that ejects its backend goes before the failed request's terminal event, which waits
# for it, and the sooner route reads it, the fewer requests reach that backend.
LINGERING = frozenset({USAGE, CACHE_ENTRIES})
ROUTED_PREFIX = "llm.routed."
PREFILLED_PREFIX = "llm.prefilled."
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


def prefilled_topic(pool: str) -> str:
    if not _NAME.match(pool):
        raise ValueError(f"invalid pool name {pool!r}")
    return PREFILLED_PREFIX + pool


def reply_topic(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"invalid reply topic name {name!r}")
    return REPLY_PREFIX + name


def is_reply_topic(topic: str) -> bool:
    return topic.startswith(REPLY_PREFIX) and bool(_NAME.match(topic[len(REPLY_PREFIX) :]))


_STREAM = "chunk.v2 | done.v2 | error.v2"


def all_topics(
    *, pools: tuple[str, ...], replies: tuple[str, ...], partitions: int, unsplit: frozenset[str] = frozenset(),
) -> list[TopicSpec]:
    """The topics for a deployment with these backend pools (those in `unsplit` have no prefill/decode
    hop: one generation stage reads their routed topic) and reply topic names."""
    day = {"retention.ms": str(DAY_MS)}
    hour = {"retention.ms": str(3600 * 1000)}
    specs = [
        TopicSpec(REQUESTS, partitions, "request.v2", day),
        TopicSpec(ADMITTED, partitions, "admitted.v2", hour),
        TopicSpec(SCREENED, partitions, "admitted.v2", hour),
        TopicSpec(GUARDED, partitions, "admitted.v2", hour),
        # Compacted (the latest entry per key); deleted after the longest entry TTL the config allows.
        TopicSpec(CACHE_ENTRIES, partitions, "cache_entry.v1 | cache_purge.v1",
                  {"cleanup.policy": "compact,delete", "retention.ms": str(7 * DAY_MS), "min.cleanable.dirty.ratio": "0.1"}),
        TopicSpec(TOKENS, partitions, _STREAM, hour),
        TopicSpec(CHECKED, partitions, _STREAM, hour),
        TopicSpec(CONTROL, partitions, "cancel.v2", hour),
        TopicSpec(HEALTH, 1, "backend_health.v1", {"cleanup.policy": "compact,delete", "retention.ms": str(3600 * 1000),
                                                   "segment.ms": str(600 * 1000)}),
        TopicSpec(DLQ, 1, "dead_letter.v1", {"retention.ms": str(7 * DAY_MS)}),
        TopicSpec(USAGE, partitions, "usage.v2", {"retention.ms": str(30 * DAY_MS)}),
    ]
    specs += [TopicSpec(routed_topic(p), partitions, "routed.v2", hour) for p in pools]
    specs += [TopicSpec(prefilled_topic(p), partitions, "prefilled.v2", hour) for p in pools if p not in unsplit]
    specs += [TopicSpec(reply_topic(r), partitions, _STREAM, hour) for r in replies]
    return specs

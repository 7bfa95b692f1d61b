"""`llm.dlq`: messages no stage could handle.

The payload itself is not copied (it may hold credentials or a prompt); the record points at it by
topic, partition and offset and carries its size and SHA-256, so an operator can fetch and replay it
within the source topic's retention. Build records with `bounded`, which caps every string field, so
a hostile message (a 600 KB id, an error naming a 600 KB field) cannot make its dead letter exceed the
broker's message size.
"""

from __future__ import annotations

from types import MappingProxyType

import msgspec

from topics.hops import MAX_REQUEST_ID_CHARS


class DeadLetter(msgspec.Struct, frozen=True, tag="dead_letter.v1", tag_field="kind"):
    stage: str
    topic: str
    partition: int
    offset: int
    error_type: str
    error: str  # the error's message; schema errors name the field, never its value
    payload_bytes: int
    payload_sha256: str
    request_id: str | None = None
    at: float = 0.0
    truncated: bool = False  # some string field was cut to its limit in LIMITS


# Characters per string field. Kafka topic names are at most 249 characters; stage names are ours.
LIMITS = MappingProxyType({
    "stage": 128,
    "topic": 256,
    "error_type": 128,
    "error": 1000,
    "payload_sha256": 64,  # a hex SHA-256
    "request_id": MAX_REQUEST_ID_CHARS,  # `<tenant>/<client id>` at their longest
})


def bounded(
    *,
    stage: str,
    topic: str,
    partition: int,
    offset: int,
    error_type: str,
    error: str,
    payload_bytes: int,
    payload_sha256: str,
    request_id: str | None = None,
    at: float = 0.0,
) -> DeadLetter:
    """A `DeadLetter` whose string fields are cut to `LIMITS`, with `truncated` set if any was cut."""
    strings = {
        "stage": stage,
        "topic": topic,
        "error_type": error_type,
        "error": error,
        "payload_sha256": payload_sha256,
    }
    if request_id is not None:
        strings["request_id"] = request_id
    cut = {name: value[: LIMITS[name]] for name, value in strings.items()}
    return DeadLetter(
        stage=cut["stage"],
        topic=cut["topic"],
        partition=partition,
        offset=offset,
        error_type=cut["error_type"],
        error=cut["error"],
        payload_bytes=payload_bytes,
        payload_sha256=cut["payload_sha256"],
        request_id=cut.get("request_id"),
        at=at,
        truncated=cut != strings,
    )

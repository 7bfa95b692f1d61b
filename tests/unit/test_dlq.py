"""`dlq.bounded`: a dead letter stays small whatever the message it points at."""

from __future__ import annotations

import msgspec

from topics.dlq import LIMITS, DeadLetter, bounded
from topics.hops import request_key

FIELDS = {
    "stage": "ingest",
    "topic": "llm.requests",
    "partition": 2,
    "offset": 41,
    "error_type": "SchemaError",
    "error": "Expected `str`, got `int` - at `$.model`",
    "payload_bytes": 120,
    "payload_sha256": "ab" * 32,
}


def test_keeps_fields_within_their_limits_and_says_nothing_was_cut() -> None:
    letter = bounded(**FIELDS, request_id="r1", at=5.0)  # type: ignore[arg-type]
    assert letter == DeadLetter(**FIELDS, request_id="r1", at=5.0)  # type: ignore[arg-type]
    assert letter.truncated is False
    assert bounded(**FIELDS).request_id is None  # type: ignore[arg-type]


def test_cuts_every_string_field_to_its_limit_and_says_so() -> None:
    huge = {name: "x" * 600_000 for name in LIMITS}
    letter = bounded(**{**FIELDS, **huge})  # type: ignore[arg-type]
    assert letter.truncated is True
    for name, limit in LIMITS.items():
        assert getattr(letter, name) == "x" * limit
    assert len(msgspec.json.encode(letter)) < 8 * 1024


def test_one_long_field_is_enough_to_set_the_flag() -> None:
    letter = bounded(**FIELDS, request_id="a" * 600_000)  # type: ignore[arg-type]
    assert letter.truncated and letter.request_id == "a" * LIMITS["request_id"]
    assert letter.error == FIELDS["error"]


def test_records_written_before_the_flag_existed_still_decode() -> None:
    old = msgspec.json.encode(DeadLetter(**FIELDS))  # type: ignore[arg-type]
    old = old.replace(b',"truncated":false', b"")
    assert b"truncated" not in old
    assert msgspec.json.decode(old, type=DeadLetter).truncated is False


def test_the_longest_request_id_is_kept_whole() -> None:
    """A tenant of 128 characters and a client id of 64: the dead letter was cut at 128."""
    rid = request_key("t" * 128, "r" * 64)
    letter = bounded(**FIELDS, request_id=rid)  # type: ignore[arg-type]
    assert letter.request_id == rid and not letter.truncated

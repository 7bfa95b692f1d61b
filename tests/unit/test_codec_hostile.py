"""Bytes a hostile producer can put on any topic: `salvage_reply` returns, `decode` raises SchemaError."""

from __future__ import annotations

import random
import re
from typing import Any

import msgspec
import pytest

from topics import codec
from topics.requests import Request

SDK = "llm.responses.sdk"
VALID = codec.encode(Request(id="r1", reply_to=SDK, model="m", created_at=1.0, prompt="hello"))
RNG = random.Random(7)
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # Request.id's rule

HOSTILE: dict[str, bytes] = {
    "empty": b"",
    "nested 5,000": b"[" * 5_000,
    "nested 100,000": b"[" * 100_000,
    "nested objects": b'{"a":' * 50_000,
    "nested closed": b"[" * 5_000 + b"]" * 5_000,
    "nested in a request": VALID[:-1] + b',"x":' + b"[" * 100_000 + b"}",
    "nested id": b'{"id":' + b"[" * 5_000 + b',"reply_to":"llm.responses.sdk"}',
    "not utf-8": b"\xff\xfe\xfd",
    "not utf-8 in a string": b'{"id":"\xff\xfe","reply_to":"llm.responses.sdk"}',
    "huge id": b'{"kind":"request.v1","id":"' + b"a" * 600_000 + b'","reply_to":"llm.responses.sdk"}',
    "huge key": b'{"' + b"k" * 600_000 + b'":1}',
    "id as a number": b'{"id":5,"reply_to":"llm.responses.sdk"}',
    "id as a big number": b'{"id":' + b"9" * 5_000 + b',"reply_to":"llm.responses.sdk"}',
    "id as an overflowing float": b'{"id":1e999,"reply_to":"llm.responses.sdk"}',
    "2 MiB of valid JSON": b'{"id":"r1","reply_to":"llm.responses.sdk","pad":"' + b"p" * (2 << 20) + b'"}',
    "2 MiB of brackets": b"[" * (2 << 20),
    "2 MiB of random bytes": RNG.randbytes(2 << 20),
    "wrong version": b'{"kind":"request.v0","id":"r1","reply_to":"llm.responses.sdk"}',
    **{f"random {i}": RNG.randbytes(RNG.randint(0, 4096)) for i in range(20)},
    **{f"truncated at {n}": VALID[:n] for n in range(0, len(VALID), 7)},
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_salvage_returns_for_any_bytes_and_only_valid_values(payload: bytes) -> None:
    rid, reply = codec.salvage_reply(payload)
    assert rid is None or CLIENT_ID.fullmatch(rid)
    assert reply in (None, SDK)


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("type_", [Request, Any, object], ids=["Request", "Any", "object"])
def test_decode_raises_only_schema_errors(payload: bytes, type_: Any) -> None:
    try:
        codec.decode(payload, type_)
    except codec.SchemaError:
        pass  # the one error decode may raise; valid JSON decoded as Any/object may also succeed


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting_is_a_schema_error(depth: int) -> None:
    with pytest.raises(codec.SchemaError, match="nested too deeply"):
        codec.decode(b"[" * depth, Any)
    assert codec.salvage_reply(b"[" * depth) == (None, None)


def test_salvages_a_valid_looking_id_and_reply_topic() -> None:
    wrong_version = b'{"kind":"request.v0","id":"r-1.a:b_c","reply_to":"llm.responses.sdk"}'
    assert codec.salvage_reply(wrong_version) == ("r-1.a:b_c", SDK)
    assert codec.salvage_reply(VALID[:-1] + b',"unknown":1}') == ("r1", SDK)
    assert codec.salvage_reply(b'{"id":"' + b"a" * 64 + b'","reply_to":"llm.responses.sdk"}') == ("a" * 64, SDK)


def test_salvages_from_the_request_a_hop_carries() -> None:
    hop = b'{"kind":"admitted.v0","id":"default/r1","request":{"id":"r1","reply_to":"llm.responses.sdk"}}'
    assert codec.salvage_reply(hop) == ("r1", SDK)


@pytest.mark.parametrize(
    "rid",
    ["a" * 65, "a" * 600_000, "", "has space", "slash/ed", "ünïcode", "new\nline", "trailing\n"]
    + [5, 5.0, True, None, ["r1"], {}],
    ids=lambda rid: repr(rid)[:24],
)
def test_refuses_ids_that_break_the_request_id_rule(rid: object) -> None:
    payload = msgspec.json.encode({"id": rid, "reply_to": SDK})
    assert codec.salvage_reply(payload) == (None, SDK)


NOT_REPLY_TOPICS = ["llm.dlq", "llm.requests", "llm.responses.", "llm.responses.UPPER", "llm.responses.a/b", 7, None]


@pytest.mark.parametrize("reply", NOT_REPLY_TOPICS)
def test_refuses_reply_topics_that_are_not_reply_topics(reply: object) -> None:
    assert codec.salvage_reply(msgspec.json.encode({"id": "r1", "reply_to": reply})) == ("r1", None)


def test_does_not_read_payloads_over_the_salvage_limit() -> None:
    small = b'{"id":"r1","reply_to":"llm.responses.sdk","pad":"'
    fits = small + b"p" * (codec.SALVAGE_MAX_BYTES - len(small) - 2) + b'"}'
    assert len(fits) == codec.SALVAGE_MAX_BYTES and codec.salvage_reply(fits) == ("r1", SDK)
    assert codec.salvage_reply(fits[:-2] + b'p"}') == (None, None)


@pytest.mark.parametrize("value", [None, "text", 5, bytearray(b'{"id":"r1","reply_to":"llm.responses.sdk"}')])
def test_salvage_accepts_only_byte_strings(value: Any) -> None:
    expected = ("r1", SDK) if isinstance(value, bytearray) else (None, None)
    assert codec.salvage_reply(value) == expected


def test_an_unknown_kind_is_named_without_echoing_it() -> None:
    payload = b'{"kind":"request.v1-' + b"x" * 600_000 + b'"}'
    with pytest.raises(codec.SchemaError) as caught:
        codec.decode(payload, Request)
    assert str(caught.value) == "unknown message kind or schema version - at `$.kind`"


@pytest.mark.parametrize("field", ["model", "reply_to", "tenant", "api_key", "client_ip", "client_attestation", "key_id"])
def test_every_string_a_refusal_may_copy_is_bounded(field: str) -> None:
    """A refusal before authentication copies the request's model (and its terminal event its reply topic):
    a request just under the broker's record limit with a 1 MB model made a refusal over it, which the
    runner retried for ever, holding ingest's partition. Such a request is unreadable instead (dead-lettered)."""
    fields = msgspec.json.decode(VALID)
    fields[field] = "a" * 1_048_000
    with pytest.raises(codec.SchemaError):
        codec.decode(msgspec.json.encode(fields), Request)

"""Bytes to typed messages and back. The only place payloads are parsed."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from topics.control import Cancel
from topics.dlq import DeadLetter
from topics.envelope import Envelope
from topics.requests import Request
from topics.stream import Chunk, Done, Failed
from topics.usage import UsageRecord

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


class SchemaError(ValueError):
    """A payload that is not valid JSON or does not match its topic's schema."""


class _Salvage(msgspec.Struct):
    """What we can still read from a message that failed its schema: who to tell."""

    id: Any = None
    reply_to: Any = None
    request: Any = None


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: type[T] | Any) -> T:
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise SchemaError(str(exc)) from None


def salvage_reply(data: bytes) -> tuple[str | None, str | None]:
    """Request id and reply topic from a payload that failed to decode, where they are readable."""
    try:
        found = msgspec.json.decode(data, type=_Salvage)
    except msgspec.DecodeError:
        return None, None
    source = found.request if isinstance(found.request, dict) else {"id": found.id, "reply_to": found.reply_to}
    rid, reply = source.get("id"), source.get("reply_to")
    return (rid if isinstance(rid, str) else None, reply if isinstance(reply, str) else None)


__all__ = [
    "SchemaError",
    "decode",
    "encode",
    "salvage_reply",
    "Cancel",
    "Chunk",
    "DeadLetter",
    "Done",
    "Envelope",
    "Failed",
    "Request",
    "UsageRecord",
]

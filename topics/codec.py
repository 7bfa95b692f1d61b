"""Bytes to typed messages and back. The only place payloads are parsed."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from topics import registry
from topics.control import Cancel
from topics.dlq import DeadLetter
from topics.hops import Admitted, Prefilled, Routed
from topics.requests import ID_PATTERN, Request
from topics.stream import Chunk, Done, Failed
from topics.usage import UsageRecord

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}

SALVAGE_MAX_BYTES = 1 << 20  # larger payloads are not parsed a second time to find who to tell
ID_MAX_CHARS = 64  # Request.id's limit
_ID = re.compile(ID_PATTERN)
# msgspec's message for a tag no member of the expected type carries (an older `request.v1`, a typo).
_BAD_TAG = re.compile(r"Invalid value .* - at `(\$[^`]*\.kind)`", re.DOTALL)


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
    except msgspec.MsgspecError as exc:  # DecodeError, and its subclass ValidationError
        raise SchemaError(_reason(exc)) from None
    except RecursionError:  # msgspec recurses once per nesting level, for a typed field as for a skipped one
        raise SchemaError("payload is nested too deeply") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for invalid UTF-8 in a string
        raise SchemaError("payload is not valid UTF-8") from None


def _reason(exc: msgspec.MsgspecError) -> str:
    message = str(exc)
    if (bad_tag := _BAD_TAG.match(message)) is not None:  # msgspec quotes the producer's tag: leave it out
        return f"unknown message kind or schema version - at `{bad_tag.group(1)}`"
    return message


def salvage_reply(data: bytes) -> tuple[str | None, str | None]:
    """Request id and reply topic from a payload that failed to decode, where they are readable.

    Never raises: this runs on bytes that already failed their schema, which may be anything a producer
    sent. Payloads over `SALVAGE_MAX_BYTES` are not read, and whatever cannot be read (nesting deeper
    than msgspec's recursion limit, invalid JSON, a value of the wrong type) gives (None, None). An id
    is returned only if it follows the client id rule of `Request.id`, a reply topic only if it names a
    reply topic (`registry.is_reply_topic`); the runner still checks that the topic is configured.
    """
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) > SALVAGE_MAX_BYTES:
        return None, None
    try:
        found = msgspec.json.decode(data, type=_Salvage)
        if isinstance(found.request, dict):  # a hop: the client's request is nested
            rid, reply = found.request.get("id"), found.request.get("reply_to")
        else:
            rid, reply = found.id, found.reply_to
    except Exception:  # the contract is "never raises": an unreadable payload names nobody to tell
        return None, None
    if not _is_client_id(rid):
        rid = None
    if not (isinstance(reply, str) and registry.is_reply_topic(reply)):
        reply = None
    return rid, reply


def _is_client_id(value: object) -> bool:
    return isinstance(value, str) and len(value) <= ID_MAX_CHARS and _ID.fullmatch(value) is not None


__all__ = [
    "SchemaError",
    "decode",
    "encode",
    "salvage_reply",
    "Cancel",
    "Chunk",
    "DeadLetter",
    "Done",
    "Admitted",
    "Prefilled",
    "Routed",
    "Failed",
    "Request",
    "UsageRecord",
]

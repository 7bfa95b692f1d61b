"""Bytes to typed messages and back. The only place payloads are parsed."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

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
_field_names: dict[Any, frozenset[str]] = {}

SALVAGE_MAX_BYTES = 1 << 20  # larger payloads are not parsed a second time to find who to tell
ID_MAX_CHARS = 64  # Request.id's limit
_ID = re.compile(ID_PATTERN)
# A schema error goes into a dead letter and a log line, and msgspec's messages can quote the producer's
# input: a value that is none of an enum's or a literal's ("Invalid enum value 'sk-...' - at `$.priority`"),
# the name of an unknown field. So a reason is built from an allow-list of msgspec's message shapes, each
# giving the kind of problem in words of the schema only (a type, a bound, a field of ours), and the path
# as far as it names the type's own fields, indices and map keys (msgspec writes a key as `[...]`); the
# rest of a path is withheld as `[…]` (an unknown field's name can itself end in " - at `$.x`").
_AT = re.compile(r"(.*) - at `(\$[^`]*)`\Z", re.DOTALL)
_KEY_AT = re.compile(r"(.*) - at `key` in `(\$[^`]*)`\Z", re.DOTALL)  # a map's key broke its schema (the key not shown)
_SEGMENT = re.compile(r"\.(\w{1,64})|\[(?:\d{1,10}|\.\.\.)\]")
_BOUND = (r"(?:, got `\w+`| of (?:at (?:least|most) )?length (?:[<>]= )?\d+(?: to \d+)?(?:, got \d+)?"
          r"| [<>]=? [\w.+-]{1,32}| that's a multiple of \d+| with(?: no)? timezone component)?")
_SHAPES: tuple[tuple[re.Pattern[str], str | None], ...] = (  # a shape -> the words to keep (None: all of them)
    (re.compile(r"Invalid (?:enum )?value .*", re.DOTALL), "Invalid value (not shown)"),  # msgspec quotes it
    (re.compile(r"Object contains unknown field .*", re.DOTALL), "Unknown field (name not shown)"),  # likewise
    (re.compile(r"Expected `str` matching regex .*", re.DOTALL), "Expected `str` matching the field's pattern"),
    (re.compile(r"Expected `[\w |]{1,64}`" + _BOUND), None),  # a type, and a bound of the schema
    (re.compile(r"Object missing required field `\w{1,64}`"), None),  # a field of the schema
    (re.compile(r"JSON is malformed: [a-z ,'{}\[\]:]{1,60} \(byte \d+\)"), None),  # msgspec's own words
    (re.compile(r"Input data was truncated|(?:Integer value|Number) out of range"), None),
)
REASON_MAX_CHARS = 300


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
        raise SchemaError(_reason(exc, type_)) from None
    except RecursionError:  # msgspec recurses once per nesting level, for a typed field as for a skipped one
        raise SchemaError("payload is nested too deeply") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for invalid UTF-8 in a string
        raise SchemaError("payload is not valid UTF-8") from None


def _reason(exc: msgspec.MsgspecError, type_: Any) -> str:
    """msgspec's message for `exc`, less anything the producer wrote (see `_SHAPES`)."""
    message, path = str(exc), ""
    if (at := _AT.fullmatch(message)) is not None:
        message, path = at.group(1), _path(at.group(2), type_)
    elif (at := _KEY_AT.fullmatch(message)) is not None:
        message, path = at.group(1), _path(at.group(2), type_) + "[key]"
    what = next((keep or message for shape, keep in _SHAPES if shape.fullmatch(message)), "Schema error")
    if message.startswith("Invalid value ") and path.endswith(".kind"):  # a tag (an older `request.v1`, a typo)
        what = "unknown message kind or schema version"
    return (f"{what} - at `{path}`" if path else what)[:REASON_MAX_CHARS]


def _path(path: str, type_: Any) -> str:
    """`path` (msgspec's `$.messages[0].role`) up to its first segment that is not a field of `type_`, an
    index or a map key; the rest as `[…]`."""
    names = _field_names.get(type_)
    if names is None:
        names = _field_names[type_] = _fields_of(msgspec.inspect.type_info(type_))
    kept, at = "$", 1
    while at < len(path):
        segment = _SEGMENT.match(path, at)
        if segment is None or (segment.group(1) is not None and segment.group(1) not in names):
            return kept + "[…]"
        kept, at = kept + segment.group(), segment.end()
    return kept


def _fields_of(info: msgspec.inspect.Type) -> frozenset[str]:
    """Every field name (as encoded, tag fields included) anywhere in the type `info` describes."""
    names: set[str] = set()
    todo: list[Any] = [info]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(tag := getattr(node, "tag_field", None), str):
            names.add(tag)
        for field in getattr(node, "fields", ()):
            names.add(field.encode_name)
            todo.append(field.type)
        todo.extend(getattr(node, "types", ()) or getattr(node, "item_types", ()))
        todo.extend(getattr(node, name) for name in ("item_type", "key_type", "value_type", "type")
                    if hasattr(node, name))
    return frozenset(names)


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

"""OTLP/HTTP trace export with a protobuf encoder written for it: the spans of one export call become one
`ExportTraceServiceRequest` in a single pass over plain bytes.

opentelemetry-exporter-otlp builds a protobuf object for every span, attribute and value before it
serializes them: about 40 microseconds per span here, in the export thread, holding the GIL the event
loop needs (docs/benchmarks.md, tracing overhead). This encoder writes the same wire format directly
(a few microseconds per span); tests/unit/observability/test_otlp.py parses its output with the
official protobuf classes and compares it with the SDK encoder's, field for field.

It encodes anything shaped like the SDK's `ReadableSpan` (the SDK's spans and `pipeline.observability.
lean`'s). The request is POSTed as `application/x-protobuf` on one kept-alive connection; a failed call
drops its batch (the batch processor calls again with the next one) and says so in the log (the
process's log filter, pipeline.logs.RateLimit, keeps that to a few lines a window).
"""

from __future__ import annotations

import http.client
import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_FLAGS_HAS_IS_REMOTE, _FLAGS_IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's remoteness is known / is remote
_VARINTS = [bytes([n]) for n in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _VARINTS[n]
    if n < 0:
        n &= (1 << 64) - 1  # int64: two's complement over ten bytes, as protobuf writes a negative int64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message) under its one-byte tag."""
    return tag + _varint(len(payload)) + payload


# Tags (field number << 3 | wire type), by the message they belong to.
_ANY_STRING, _ANY_BOOL, _ANY_INT, _ANY_DOUBLE, _ANY_ARRAY, _ANY_KVLIST, _ANY_BYTES = b"\x0a", b"\x10", b"\x18", b"\x21", b"\x2a", b"\x32", b"\x3a"
_KV_KEY, _KV_VALUE = b"\x0a", b"\x12"
_SPAN_TRACE_ID, _SPAN_ID, _SPAN_TRACE_STATE, _SPAN_PARENT, _SPAN_NAME, _SPAN_KIND = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x30"
_SPAN_START, _SPAN_END, _SPAN_ATTR, _SPAN_DROPPED_ATTR, _SPAN_EVENT = b"\x39", b"\x41", b"\x4a", b"\x50", b"\x5a"
_SPAN_DROPPED_EVENTS, _SPAN_LINK, _SPAN_DROPPED_LINKS, _SPAN_STATUS, _SPAN_FLAGS = b"\x60", b"\x6a", b"\x70", b"\x7a", b"\x85\x01"
_EVENT_TIME, _EVENT_NAME, _EVENT_ATTR, _EVENT_DROPPED = b"\x09", b"\x12", b"\x1a", b"\x20"
_LINK_TRACE_ID, _LINK_SPAN_ID, _LINK_TRACE_STATE, _LINK_ATTR, _LINK_DROPPED, _LINK_FLAGS = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x28", b"\x35"
_STATUS_MESSAGE, _STATUS_CODE = b"\x12", b"\x18"
_SCOPE_NAME, _SCOPE_VERSION, _SCOPE_ATTR = b"\x0a", b"\x12", b"\x1a"
_RESOURCE_ATTR = b"\x0a"
_RS_RESOURCE, _RS_SCOPE_SPANS, _RS_SCHEMA = b"\x0a", b"\x12", b"\x1a"
_SS_SCOPE, _SS_SPAN, _SS_SCHEMA = b"\x0a", b"\x12", b"\x1a"
_REQUEST_RESOURCE_SPANS = b"\x0a"
_FIXED64, _FIXED32, _DOUBLE = struct.Struct("<Q"), struct.Struct("<I"), struct.Struct("<d")


def _any_value(value: Any) -> bytes:
    """An AnyValue; bool is tested before int (a bool is an int in Python)."""
    if isinstance(value, str):
        return _ld(_ANY_STRING, value.encode())
    if isinstance(value, bool):
        return _ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _ANY_INT + _varint(value)
    if isinstance(value, float):
        return _ANY_DOUBLE + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _ld(_ANY_BYTES, value)
    if isinstance(value, Mapping):
        return _ld(_ANY_KVLIST, _attributes(b"\x0a", value))
    if isinstance(value, Sequence):
        return _ld(_ANY_ARRAY, b"".join(_ld(b"\x0a", _any_value(v)) for v in value))
    raise TypeError(f"an attribute value of type {type(value).__name__} has no OTLP form")


_pairs: dict[tuple[bytes, str, Any], bytes] = {}  # an encoded attribute by (tag, key, value): the same few repeat on every span
_MAX_PAIRS = 8192


def _pair(tag: bytes, key: str, value: Any) -> bytes:
    return _ld(tag, _ld(_KV_KEY, key.encode()) + _ld(_KV_VALUE, _any_value(value)))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Encoded KeyValues; a string or bool value (topic, stage and outcome names) is encoded once per
    process and looked up afterwards (bounded: past `_MAX_PAIRS` new pairs are encoded every time)."""
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        if value.__class__ is str or value.__class__ is bool:
            cached = _pairs.get((tag, key, value))
            if cached is None:
                cached = _pair(tag, key, value)
                if len(_pairs) < _MAX_PAIRS:
                    _pairs[(tag, key, value)] = cached
            out.append(cached)
        else:
            out.append(_pair(tag, key, value))
    return b"".join(out)


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def flatten(span: Any, origins: dict[tuple[int, int], tuple[Any, Any, tuple]]) -> tuple:
    """A span (the SDK's `ReadableSpan` or the lean recorder's) as the plain tuple the encoder reads, which
    also crosses a pipe to the export child as it is; `origins` keeps one tuple per (resource, scope), so
    pickle writes it once per batch and the encoder groups by it:

        (trace_id, span_id, trace_state items, (parent span_id, parent is_remote) | None, name, kind value,
         start, end, attributes, dropped attributes, events ((time, name, attributes, dropped), ...), dropped
         events, links ((trace_id, span_id, is_remote, attributes, dropped), ...), dropped links,
         (status code value, description) | None, origin: (resource items, resource schema, scope | None))
    """
    context, parent, status = span.context, span.parent, span.status
    resource, scope = span.resource, span.instrumentation_scope
    key = (id(resource), id(scope))
    kept = origins.get(key)
    if kept is None or kept[0] is not resource or kept[1] is not scope:
        origin = (tuple(dict(resource.attributes).items()), resource.schema_url,
                  None if scope is None else (scope.name, scope.version, tuple(dict(scope.attributes or {}).items()), scope.schema_url))
        kept = origins[key] = (resource, scope, origin)
    attributes = span.attributes
    events, links = span.events, span.links
    return (
        context.trace_id, context.span_id, tuple(context.trace_state.items()) if context.trace_state else (),
        None if parent is None else (parent.span_id, parent.is_remote),
        span.name, span.kind.value, span.start_time or 0, span.end_time or 0,
        attributes if attributes.__class__ is dict else dict(attributes or {}), span.dropped_attributes,
        tuple((e.timestamp, e.name, dict(e.attributes or {}), e.dropped_attributes) for e in events) if events else (),
        span.dropped_events,
        tuple((link.context.trace_id, link.context.span_id, link.context.is_remote, dict(link.attributes or {}),
               link.dropped_attributes) for link in links) if links else (),
        span.dropped_links,
        None if status is None else (status.status_code.value, status.description),
        kept[2],
    )


_TRACE_ID_HEAD, _SPAN_ID_HEAD, _PARENT_HEAD = _SPAN_TRACE_ID + b"\x10", _SPAN_ID + b"\x08", _SPAN_PARENT + b"\x08"
_KINDS = [_SPAN_KIND + _varint(k + 1) for k in range(6)]  # OTLP counts from SPAN_KIND_UNSPECIFIED = 0
_SPAN_FLAGS_BY_REMOTE = {remote: _SPAN_FLAGS + _FIXED32.pack(_FLAGS_HAS_IS_REMOTE | (_FLAGS_IS_REMOTE if remote else 0))
                         for remote in (False, True)}


def encode_span(flat: tuple) -> bytes:
    """One `Span` message from a `flatten()` tuple, as the SDK's encoder fills it."""
    (trace_id, span_id, state, parent, name, kind, start, end, attributes, dropped_attributes, events, dropped_events,
     links, dropped_links, status, _) = flat
    parts = [_TRACE_ID_HEAD + trace_id.to_bytes(16, "big"), _SPAN_ID_HEAD + span_id.to_bytes(8, "big")]
    if state:
        parts.append(_ld(_SPAN_TRACE_STATE, ",".join(f"{k}={v}" for k, v in state).encode()))
    if parent is not None:
        parts.append(_PARENT_HEAD + parent[0].to_bytes(8, "big"))
    if name:
        parts.append(_ld(_SPAN_NAME, name.encode()))
    parts += [_KINDS[kind], _SPAN_START + _FIXED64.pack(start), _SPAN_END + _FIXED64.pack(end), _attributes(_SPAN_ATTR, attributes)]
    if dropped_attributes:
        parts.append(_SPAN_DROPPED_ATTR + _varint(dropped_attributes))
    for timestamp, event_name, event_attributes, event_dropped in events:
        parts.append(_ld(_SPAN_EVENT, _EVENT_TIME + _FIXED64.pack(timestamp) + _ld(_EVENT_NAME, event_name.encode())
                         + _attributes(_EVENT_ATTR, event_attributes) + _count(_EVENT_DROPPED, event_dropped)))
    parts.append(_count(_SPAN_DROPPED_EVENTS, dropped_events))
    for link_trace, link_span, link_remote, link_attributes, link_dropped in links:
        parts.append(_ld(_SPAN_LINK, _ld(_LINK_TRACE_ID, link_trace.to_bytes(16, "big")) + _ld(_LINK_SPAN_ID, link_span.to_bytes(8, "big"))
                         + _attributes(_LINK_ATTR, link_attributes) + _count(_LINK_DROPPED, link_dropped) + _LINK_FLAGS
                         + _FIXED32.pack(_FLAGS_HAS_IS_REMOTE | (_FLAGS_IS_REMOTE if link_remote else 0))))
    parts.append(_count(_SPAN_DROPPED_LINKS, dropped_links))
    if status is not None:
        code, description = status
        parts.append(_ld(_SPAN_STATUS, (_ld(_STATUS_MESSAGE, description.encode()) if description else b"") + _count(_STATUS_CODE, code)))
    parts.append(_SPAN_FLAGS_BY_REMOTE[parent is not None and bool(parent[1])])
    return b"".join(parts)


class Encoder:
    """Spans to one ExportTraceServiceRequest, grouped by resource and instrumentation scope (each
    encoded once per encoder, they repeat on every call). `encode` takes span objects; `encode_flat`
    their `flatten()` tuples (what the export child receives)."""

    def __init__(self) -> None:
        self._origins: dict[tuple[int, int], tuple[Any, Any, tuple]] = {}
        self._resources: dict[tuple, bytes] = {}
        self._scopes: dict[tuple, bytes] = {}

    def encode(self, spans: Sequence[Any]) -> bytes:
        origins = self._origins
        return self.encode_flat([flatten(span, origins) for span in spans])

    def encode_flat(self, spans: Sequence[tuple]) -> bytes:
        by_origin: dict[int, tuple[tuple, list[bytes]]] = {}  # by id: an origin is one object per batch
        for flat in spans:
            origin = flat[15]
            group = by_origin.get(id(origin))
            if group is None:
                group = by_origin[id(origin)] = (origin, [])
            group[1].append(_ld(_SS_SPAN, encode_span(flat)))
        resources: dict[tuple, dict[Any, list[bytes]]] = {}  # the SDK's grouping: by resource, then by scope
        for origin, encoded_spans in by_origin.values():
            resources.setdefault(origin[:2], {}).setdefault(origin[2], []).extend(encoded_spans)
        out = []
        for (resource_items, resource_schema), scopes in resources.items():
            body = [_ld(_RS_RESOURCE, self._resource(resource_items))]
            for scope, encoded_spans in scopes.items():
                head = _ld(_SS_SCOPE, self._scope(scope)) if scope is not None else b""
                schema = _ld(_SS_SCHEMA, scope[3].encode()) if scope is not None and scope[3] else b""
                body.append(_ld(_RS_SCOPE_SPANS, head + b"".join(encoded_spans) + schema))
            if resource_schema:
                body.append(_ld(_RS_SCHEMA, resource_schema.encode()))
            out.append(_ld(_REQUEST_RESOURCE_SPANS, b"".join(body)))
        return b"".join(out)

    def _resource(self, items: tuple) -> bytes:
        cached = self._resources.get(items)
        if cached is None:
            cached = self._resources[items] = _attributes(_RESOURCE_ATTR, dict(items))
        return cached

    def _scope(self, scope: tuple) -> bytes:
        cached = self._scopes.get(scope)
        if cached is None:
            name, version, items, _ = scope
            cached = self._scopes[scope] = (_ld(_SCOPE_NAME, name.encode()) if name else b"") + \
                (_ld(_SCOPE_VERSION, version.encode()) if version else b"") + _attributes(_SCOPE_ATTR, dict(items))
        return cached


class OtlpHttpExporter(SpanExporter):
    """POSTs each batch to `endpoint` (OTLP/HTTP, protobuf) on one kept-alive connection."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError("an OTLP endpoint is an http:// or https:// URL")
        self._url = url
        self._path = url.path or "/v1/traces"
        self._timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self._encoder = Encoder()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self.post(self._encoder.encode(spans), len(spans))

    def export_flat(self, spans: Sequence[tuple]) -> SpanExportResult:
        """Exports spans already flattened (`flatten()`): what the export child receives."""
        return self.post(self._encoder.encode_flat(spans), len(spans))

    def post(self, body: bytes, count: int) -> SpanExportResult:
        for attempt in (1, 2):  # a kept-alive connection the server closed meanwhile fails once, at once
            try:
                status = self._post(body)
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                if attempt == 2:
                    log.warning("OTLP export of %d spans failed: %s", count, type(exc).__name__)
                    return SpanExportResult.FAILURE
                continue
            if 200 <= status < 300:
                return SpanExportResult.SUCCESS
            log.warning("OTLP export of %d spans refused: HTTP %d", count, status)
            return SpanExportResult.FAILURE
        return SpanExportResult.FAILURE

    def _post(self, body: bytes) -> int:
        if self._conn is None:
            kind = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            self._conn = kind(self._url.hostname or "", self._url.port, timeout=self._timeout_s)
        self._conn.request("POST", self._path, body=body, headers={"Content-Type": "application/x-protobuf"})
        response = self._conn.getresponse()
        response.read()
        return response.status

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def shutdown(self) -> None:
        self._close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

"""W3C trace context carried in Kafka headers, and the tracer the runner uses. Spans carry ids,
sizes and outcomes, never prompt text or credentials."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

Headers = Sequence[tuple[str, bytes]]

tracer = trace.get_tracer("sluice")

MAX_HEADER_BYTES = 512  # a traceparent is 55 bytes; W3C lets tracestate reach 512 characters
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})


def install(exporter: SpanExporter | None = None) -> TracerProvider:
    """Sets an SDK tracer provider (once per process); spans are exported only if an exporter is given."""
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def extract(headers: Iterable[Any] | None) -> context.Context:
    """The trace context a record's headers carry. Never raises: headers come from any producer, and a
    trace link is advisory, so a header that is not a (str, bytes) pair, a value that is not ASCII or
    is longer than `MAX_HEADER_BYTES`, or a propagator that fails on what is left, only costs the link
    (the span starts a new trace)."""
    carrier: dict[str, str] = {}
    try:
        for item in headers or ():
            if not isinstance(item, tuple | list) or len(item) != 2:
                continue
            key, value = item
            if not (isinstance(key, str) and key in _TRACE_KEYS and isinstance(value, bytes)):
                continue
            if len(value) <= MAX_HEADER_BYTES and value.isascii():
                carrier[key] = value.decode("ascii")
        return propagate.extract(carrier)
    except Exception:  # a headers object that fails to iterate, or a propagator that fails: no link
        return context.get_current()


def inject() -> list[tuple[str, bytes]]:
    """Headers for the current span's context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode("latin-1")) for k, v in carrier.items()]

"""W3C trace context carried in Kafka headers, and the tracer the runner uses. Spans carry ids,
sizes and outcomes, never prompt text or credentials."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

Headers = Sequence[tuple[str, bytes]]

tracer = trace.get_tracer("sluice")


def install(exporter: SpanExporter | None = None) -> TracerProvider:
    """Sets an SDK tracer provider (once per process); spans are exported only if an exporter is given."""
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def extract(headers: Headers | None) -> context.Context:
    carrier = {k: v.decode("latin-1") for k, v in headers or () if k in ("traceparent", "tracestate")}
    return propagate.extract(carrier)


def inject() -> list[tuple[str, bytes]]:
    """Headers for the current span's context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode("latin-1")) for k, v in carrier.items()]

"""One trace per request across every Kafka hop: W3C trace context in Kafka headers, the spans the
runner makes around each record and each produce, and the exporter. Spans carry ids, sizes, offsets and
outcomes, never prompt text, credentials or a tenant's name.

    client (SDK / bridge)   "chat <model>" (CLIENT; under the bridge's SERVER span) -> "send llm.requests" (PRODUCER)
    every stage             "<stage>" (CONSUMER: messaging.* and messaging.kafka.* attributes), whose
                              context the headers of every message it produces carry to the next stage;
                              with `observability.producer_spans`, a "send <topic>" (PRODUCER) span per
                              message in between (off by default: it doubles the spans of a request, and
                              docs/benchmarks.md measures what each span costs)

Spans follow OpenTelemetry's messaging conventions (`messaging.system`, `messaging.operation.type`,
`messaging.destination.name`, `messaging.consumer.group.name`, `messaging.destination.partition.id`,
`messaging.kafka.offset`, `messaging.message.body.size`). Sampling is parent-based: a client decides
(`observability.sample_ratio`) and every stage follows the `traceparent` flag it received, so a trace is
kept whole or not at all. Export is batched in a background thread (BatchSpanProcessor) over OTLP/HTTP
with sluice's own protobuf encoder (pipeline.observability.otlp: the same bytes, a third of the CPU); a
full queue drops spans, it never slows a stage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeline import metrics
from pipeline.observability.config import ObservabilitySettings
from pipeline.observability.otlp import OtlpHttpExporter
from pipeline.observability.recent import TRACES

Headers = Sequence[tuple[str, bytes]]

tracer = trace.get_tracer("sluice")

MAX_HEADER_BYTES = 512  # a traceparent is 55 bytes; W3C lets tracestate reach 512 characters
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})
CONSUMER, PRODUCER = trace.SpanKind.CONSUMER, trace.SpanKind.PRODUCER
_W3C = TraceContextTextMapPropagator()  # traceparent and tracestate only: no baggage crosses a hop
_options = {"producer_spans": False}  # set once by install(), like the tracer provider itself


def install(settings: ObservabilitySettings | None = None, exporter: SpanExporter | None = None,
            sampler: Sampler | None = None) -> TracerProvider:
    """Sets the process's tracer provider (once per process: OpenTelemetry ignores a second one and says
    so). `sampler` replaces the configured ratio (a benchmark switches it). Spans are exported in batches to `exporter`, else to `settings.otlp_endpoint` over OTLP/HTTP,
    else nowhere (they are still made, so trace context still flows to processes that do export)."""
    settings = settings or ObservabilitySettings()
    sampler = sampler or ParentBased(TraceIdRatioBased(settings.sample_ratio))
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}), sampler=sampler)
    if exporter is None and settings.otlp_endpoint:
        exporter = OtlpHttpExporter(settings.otlp_endpoint, settings.otlp_timeout_s)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=settings.export_queue, max_export_batch_size=settings.export_batch,
            schedule_delay_millis=settings.export_delay_ms,
        ))
    provider.add_span_processor(TRACES)  # the dashboard's waterfall of the last request
    _options["producer_spans"] = settings.producer_spans
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
        return _W3C.extract(carrier)
    except Exception:  # a headers object that fails to iterate, or a propagator that fails: no link
        return context.get_current()


def inject(ctx: context.Context | None = None) -> list[tuple[str, bytes]]:
    """Headers for `ctx` (default: the current span's context)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=ctx)
    return [(k, v.encode("latin-1")) for k, v in carrier.items()]


@contextlib.contextmanager
def consume_span(record: Any, group: str) -> Iterator[trace.Span]:
    """The CONSUMER span of one record at stage `group` (the stage's name: its consumer group and span
    name), continuing the trace its headers carry; also observes the record's queue time (from its
    produce timestamp to now, when the stage starts on it)."""
    timestamp = getattr(record, "timestamp", None)
    if isinstance(timestamp, int) and timestamp > 0:
        metrics.QUEUE_SECONDS.labels(group).observe(max(0.0, time.time() - timestamp / 1000.0))
    attributes = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.destination.name": record.topic,
        "messaging.consumer.group.name": group,
        "messaging.destination.partition.id": str(record.partition),
        "messaging.kafka.offset": record.offset,
        "messaging.message.body.size": len(record.value or b""),
    }
    with tracer.start_as_current_span(group, context=extract(record.headers), kind=CONSUMER, attributes=attributes) as span:
        yield span


def publish(topic: str, parent: context.Context | None = None, *, span: bool | None = None) -> list[tuple[str, bytes]]:
    """The headers that carry the trace of one message to `topic` to its consumer: the context of `parent`
    (default: the current span), or, with `span` (default `observability.producer_spans`), of a PRODUCER
    span made for the message as a child of it, covering its hand-over to the producer (the broker's
    acknowledgement is the consumer span's queue time). Outside any trace (a stage's clocked health
    report) nothing is sent: a trace of one span is only noise."""
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return []
    if not (_options["producer_spans"] if span is None else span):
        return inject(parent)
    producer = tracer.start_span(f"send {topic}", context=parent, kind=PRODUCER, attributes={
        "messaging.system": "kafka", "messaging.operation.type": "send", "messaging.operation.name": "send",
        "messaging.destination.name": topic,
    })
    try:
        return inject(trace.set_span_in_context(producer, parent))
    finally:
        producer.end()

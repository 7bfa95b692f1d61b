"""One trace per request across every Kafka hop: W3C trace context in Kafka headers, the spans the
runner makes around each record and each produce, and the exporter. Spans carry ids, sizes, offsets and
outcomes, never prompt text or credentials. They do name tenants: a stage's `request.id` attribute is the
pipeline's request id, `<tenant>/<client id>` (docs/operations.md; at ingest, before authentication, the
client's id alone). A stage's span ended by an exception has status ERROR with the exception's class
name, never its message, whichever recorder records it.

    client (SDK / bridge)   "chat <model>" (CLIENT; under the bridge's SERVER span) -> "send llm.requests" (PRODUCER)
    every stage             "<stage>" (CONSUMER: messaging.* and messaging.kafka.* attributes), whose
                              context the headers of every message it produces carry to the next stage;
                              with `observability.producer_spans`, a "send <topic>" (PRODUCER) span per
                              message in between (off by default: it doubles the spans of a request, and
                              docs/benchmarks.md measures what each span costs)
    a handed-over message   "<stage>" (CONSUMER, `sluice.handover`), a child of the sender's span: a stage
                              of the same process took it in hand instead of the broker carrying it

Spans follow OpenTelemetry's messaging conventions (`messaging.system`, `messaging.operation.type`,
`messaging.destination.name`, `messaging.consumer.group.name`, `messaging.destination.partition.id`,
`messaging.kafka.offset`, `messaging.message.body.size`). Sampling is parent-based: a client decides
(`observability.sample_ratio`) and every stage follows the `traceparent` flag it received, so a trace is
kept whole or not at all. Export is batched in a background thread (BatchSpanProcessor) that hands each
batch to a child process (pipeline.observability.export_child), which encodes it with sluice's own
protobuf encoder (pipeline.observability.otlp: the same bytes as the SDK's, a third of the CPU) and posts
it over OTLP/HTTP; a full queue drops spans, it never slows a stage.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode, TraceState

from pipeline import metrics
from pipeline.observability.config import ObservabilitySettings
from pipeline.observability.export_child import ChildExporter
from pipeline.observability.lean import LeanTracerProvider
from pipeline.observability.otlp import OtlpHttpExporter
from pipeline.observability.recent import TRACES

Headers = Sequence[tuple[str, bytes]]

tracer = trace.get_tracer("sluice")  # a proxy until install() puts the provider's own tracer here

MAX_HEADER_BYTES = 512  # a traceparent is 55 bytes; W3C lets tracestate reach 512 characters
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})
CONSUMER, PRODUCER = trace.SpanKind.CONSUMER, trace.SpanKind.PRODUCER
# W3C trace context (no baggage crosses a hop): version-trace_id-span_id-flags, lower-case hex, as
# opentelemetry's TraceContextTextMapPropagator matches it (a future version may append fields).
_TRACEPARENT = re.compile(r"\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
# A W3C tracestate list member (key "=" value), the grammar opentelemetry's TraceState parser checks; sluice
# checks it first, because that parser logs each member it refuses, text and all, at WARNING: a member
# with a newline in it would forge a log line. A header with a member outside it, or with more than 32
# members, is dropped without a word (the parser would drop it too).
_TRACESTATE_MEMBER = re.compile(r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
                                r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_TRACESTATE_MEMBERS = 32
_options = {"producer_spans": False}  # set once by install(), like the tracer provider itself


def install(settings: ObservabilitySettings | None = None, exporter: SpanExporter | None = None,
            sampler: Sampler | None = None) -> TracerProvider:
    """Sets the process's tracer provider (once per process: OpenTelemetry ignores a second one and says
    so). `sampler` replaces the configured ratio (a benchmark switches it). Spans are recorded by sluice's
    lean recorder (or, `observability.recorder = "sdk"`, the SDK's) and exported in batches to `exporter`,
    else to `settings.otlp_endpoint` over OTLP/HTTP, else nowhere (they are still made, so trace context
    still flows to processes that do export, and the dashboard shows the last ones)."""
    settings = settings or ObservabilitySettings()
    sampler = sampler or ParentBased(TraceIdRatioBased(settings.sample_ratio))
    kind = LeanTracerProvider if settings.recorder == "lean" else TracerProvider
    provider = kind(resource=Resource.create({"service.name": settings.service_name}), sampler=sampler)
    if exporter is None and settings.otlp_endpoint:
        exporter = otlp_exporter(settings)
    if exporter is not None:
        provider.add_span_processor(batches(exporter, settings))
    provider.add_span_processor(TRACES)  # the dashboard's waterfall of the last request
    _options["producer_spans"] = settings.producer_spans
    trace.set_tracer_provider(provider)
    global tracer  # the proxy would wrap every span in one more context manager, resolving the provider each time
    tracer = trace.get_tracer_provider().get_tracer("sluice")
    return provider


def otlp_exporter(settings: ObservabilitySettings) -> SpanExporter:
    """The exporter to `settings.otlp_endpoint`: in a child process (`export_process`, the default), else in
    the batch processor's thread."""
    if settings.export_process:
        return ChildExporter(settings.otlp_endpoint, settings.otlp_timeout_s)
    return OtlpHttpExporter(settings.otlp_endpoint, settings.otlp_timeout_s)


class Batches(BatchSpanProcessor):
    """The SDK's batch processor, whose force_flush also waits for the exporter's own flush (the export
    child posts after `export()` has returned)."""

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        return super().force_flush(timeout_millis) and self.span_exporter.force_flush(timeout_millis or 30000)


def batches(exporter: SpanExporter, settings: ObservabilitySettings) -> Batches:
    return Batches(exporter, max_queue_size=settings.export_queue, max_export_batch_size=settings.export_batch,
                   schedule_delay_millis=settings.export_delay_ms)


def extract(headers: Iterable[Any] | None) -> context.Context:
    """The trace context a record's headers carry (W3C `traceparent` and `tracestate`, read as OpenTelemetry's
    TraceContextTextMapPropagator reads them, without its per-call carrier and getter). Never raises:
    headers come from any producer, and a trace link is advisory, so a header that is not a (str, bytes)
    pair, a value that is not ASCII or is longer than `MAX_HEADER_BYTES`, or a value the format refuses,
    only costs the link (the span starts a new trace). A `tracestate` outside W3C's grammar is dropped
    before opentelemetry's parser sees it (that parser logs what it refuses): the link stays, without it."""
    parent = state = None
    try:
        for item in headers or ():
            if not isinstance(item, tuple | list) or len(item) != 2:
                continue
            key, value = item
            if not (isinstance(key, str) and key in _TRACE_KEYS and isinstance(value, bytes)):
                continue
            if len(value) <= MAX_HEADER_BYTES and value.isascii():
                if key == "traceparent":
                    parent = value.decode("ascii")
                else:
                    state = value.decode("ascii")
        match = _TRACEPARENT.fullmatch(parent) if parent is not None else None
        if match is None:
            return context.get_current()
        version, trace_id, span_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return context.get_current()
        span_context = trace.SpanContext(int(trace_id, 16), int(span_id, 16), True, trace.TraceFlags(int(flags, 16)),
                                         _trace_state(state) if state is not None else None)
        return trace.set_span_in_context(trace.NonRecordingSpan(span_context), context.get_current())
    except Exception:  # a headers object that fails to iterate, a tracestate the parser refuses: no link
        return context.get_current()


def _trace_state(header: str) -> TraceState | None:
    """The TraceState `header` holds, or None (an empty one) if any member breaks W3C's grammar."""
    members = [member for member in (item.strip(" \t") for item in header.split(",")) if member]  # as the parser splits
    if len(members) > _TRACESTATE_MEMBERS or not all(_TRACESTATE_MEMBER.fullmatch(member) for member in members):
        return None
    return TraceState.from_header([header])


def inject(ctx: context.Context | None = None) -> list[tuple[str, bytes]]:
    """Headers for `ctx` (default: the current span's context): `traceparent`, and `tracestate` when it has entries."""
    span_context = trace.get_current_span(ctx).get_span_context()
    if not span_context.is_valid:
        return []
    headers = [("traceparent", f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}".encode())]
    if span_context.trace_state:
        headers.append(("tracestate", span_context.trace_state.to_header().encode("latin-1")))
    return headers


def consume_span(record: Any, group: str) -> contextlib.AbstractContextManager[trace.Span]:
    """The CONSUMER span of one record at stage `group` (the stage's name: its consumer group and span
    name), continuing the trace its headers carry, to be entered at once (`with`); also observes the
    record's queue time (from its produce timestamp to now, when the stage starts on it). Its context
    manager is `_StageSpan`, not the tracer's: no generator per message."""
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
    return _StageSpan(tracer.start_span(group, context=extract(record.headers), kind=CONSUMER, attributes=attributes,
                                        record_exception=False, set_status_on_exception=False))


def handover_span(topic: str, group: str) -> contextlib.AbstractContextManager[trace.Span]:
    """The span of stage `group` handling a message that a stage of the same process handed over on
    `topic` instead of producing it (`runtime.handover`): a child of the sender's span, with the
    messaging attributes a consumed record's span has, less the partition and offset it never had.
    Its queue time is nil: the stage takes it at once."""
    metrics.QUEUE_SECONDS.labels(group).observe(0.0)
    attributes = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.destination.name": topic,
        "messaging.consumer.group.name": group,
        "sluice.handover": True,
    }
    return _StageSpan(tracer.start_span(group, kind=CONSUMER, attributes=attributes, record_exception=False,
                                        set_status_on_exception=False))


class _StageSpan:
    """A stage's span as the current span while the stage works (`with`), ended on the way out; what the
    tracer's `start_as_current_span` does, in one small class instead of the tracer's generators, and
    with its own rule for an exception: status ERROR with the exception's class name, never its message.
    The SDK's rule (`recorder = "sdk"`) would add an exception event and the description
    `"<class>: <message>"`, and a message can quote a prompt or a key (a decode error quoting its input,
    a Redis error quoting a command); so the span is started with both of its switches off, and the SDK
    never sees the exception."""

    __slots__ = ("_token", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def __enter__(self) -> trace.Span:
        self._token = context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is not None and not issubclass(kind, GeneratorExit):  # an async generator closed: no error
                self.span.set_status(Status(StatusCode.ERROR, kind.__name__))
        finally:
            context.detach(self._token)
            self.span.end()


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

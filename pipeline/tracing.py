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
`messaging.kafka.offset`, `messaging.message.body.size`). Sampling is parent-based inside the pipeline:
where a trace starts, or enters from outside (ingest's records on llm.requests, which any producer allowed
to write the topic fills in: `extract(inbound=True)`), the configured sampler (`observability.sample_ratio`)
decides; every later stage follows the `traceparent` flag it received, so the pipeline's part of a trace is
kept whole or not at all. Export is batched in a background thread (BatchSpanProcessor) that hands each
batch to a child process (pipeline.observability.export_child), which encodes it with sluice's own
protobuf encoder (pipeline.observability.otlp: the same bytes as the SDK's, a third of the CPU) and posts
it over OTLP/HTTP; a full queue drops spans, it never slows a stage.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode, TraceFlags, TraceState

from pipeline import metrics
from pipeline.observability.config import ObservabilitySettings
from pipeline.observability.export_child import ChildExporter
from pipeline.observability.lean import MAX_ATTRIBUTE_CHARS, LeanTracerProvider
from pipeline.observability.otlp import OtlpHttpExporter
from pipeline.observability.recent import TRACES
from topics import registry

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
# The topics whose records carry a context from outside the pipeline: a tenant may write llm.requests itself
# (docs/security.md), so its `traceparent` flag and `tracestate` are its own choice (llm.control is writable
# too, but no span is made of its records).
_INBOUND = frozenset({registry.REQUESTS})
_NO_PARENT = context.Context()  # what the sampler is shown of a trace entering from outside
_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
# set once by install(), like the tracer provider itself; the sampler is the provider's
_options: dict[str, Any] = {"producer_spans": False, "trust_inbound_context": False,
                            "sampler": ParentBased(TraceIdRatioBased(ObservabilitySettings.sample_ratio))}


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
    provider = kind(resource=Resource.create({"service.name": settings.service_name}), sampler=sampler,
                    span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS))  # the lean one's own bound
    if exporter is None and settings.otlp_endpoint:
        exporter = otlp_exporter(settings)
    if exporter is not None:
        provider.add_span_processor(batches(exporter, settings))
    provider.add_span_processor(TRACES)  # the dashboard's waterfall of the last request
    _options.update(producer_spans=settings.producer_spans, trust_inbound_context=settings.trust_inbound_context,
                    sampler=sampler)
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


def extract(headers: Iterable[Any] | None, inbound: bool = False) -> context.Context:
    """The trace context a record's headers carry (W3C `traceparent` and `tracestate`, read as OpenTelemetry's
    TraceContextTextMapPropagator reads them, without its per-call carrier and getter). Never raises:
    headers come from any producer, and a trace link is advisory, so a header that is not a (str, bytes)
    pair, a value that is not ASCII or is longer than `MAX_HEADER_BYTES`, or a value the format refuses,
    only costs the link (the span starts a new trace). A `tracestate` outside W3C's grammar is dropped
    before opentelemetry's parser sees it (that parser logs what it refuses): the link stays, without it.

    `inbound`: the headers come from outside the pipeline (a record on llm.requests), where the producer
    chose them. Unless `observability.trust_inbound_context`, the client's `sampled` flag and `tracestate`
    are then not followed: the configured sampler decides as for a trace begun here (`_operators_draw`),
    and no tracestate is carried on. The client's trace id and span id stay as the parent: the SDK's and
    the bridge's spans (the request's CLIENT and SERVER spans) are in that trace, and ingest cannot tell
    the bridge's records from a tenant's own, so a new trace would split every request's trace in two.
    What a client can still choose is a trace id, only for its own requests' spans (named by the request
    id ingest mints under its tenant), and only as many as the operator's ratio records."""
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
        if inbound and not _options["trust_inbound_context"]:
            span_context = trace.SpanContext(int(trace_id, 16), int(span_id, 16), True, _operators_draw())
        else:
            span_context = trace.SpanContext(int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)),
                                             _trace_state(state) if state is not None else None)
        return trace.set_span_in_context(trace.NonRecordingSpan(span_context), context.get_current())
    except Exception:  # a headers object that fails to iterate, a tracestate the parser refuses: no link
        return context.get_current()


def _operators_draw() -> TraceFlags:
    """The flags of a trace entering from outside: the configured sampler's decision for a trace begun here,
    on a trace id drawn here (a ratio sampler decides by the trace id; the client's would let it choose the
    outcome), so `sample_ratio` bounds what is recorded whatever the client's flag says."""
    result = _options["sampler"].should_sample(_NO_PARENT, random.getrandbits(128) or 1, "inbound")
    return _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED


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
    name), continuing the trace its headers carry (on a topic clients write, with the sampling decision
    `extract(inbound=True)` makes), to be entered at once (`with`); also observes the record's queue time
    (from its produce timestamp to now, when the stage starts on it). Its context manager is `_StageSpan`,
    not the tracer's: no generator per message."""
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
    parent = extract(record.headers, record.topic in _INBOUND)
    return _StageSpan(tracer.start_span(group, context=parent, kind=CONSUMER, attributes=attributes,
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

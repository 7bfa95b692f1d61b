"""sluice's span recorder: the OpenTelemetry tracing API, implemented with a fraction of the SDK's work
per span, for a pipeline that makes one span per stage per message.

The SDK's tracer costs about 50 microseconds a span here (sampler, attribute validation with locks,
bounded event and link lists, two layers of context managers; docs/benchmarks.md, tracing overhead).
`LeanTracerProvider` is the SDK's TracerProvider (same resource, sampler and span processors, so the
BatchSpanProcessor, the OTLP exporter and the dashboard's processor take its spans unchanged) whose
tracers make `LeanSpan`s:

    sampling      parent-based: a span with a valid parent is recorded iff the parent was (its
                  `traceparent` flag); only a root asks the provider's sampler (and
                  `pipeline.tracing.extract`, for a context from outside: there the flag is its draw)
    attributes    a plain dict; values of the types OTLP carries (str, bool, int, float, bytes and
                  sequences of them), others dropped; at most MAX_ATTRIBUTES, the rest counted dropped;
                  a string cut to MAX_ATTRIBUTE_CHARS (bytes too), as the SDK's
                  `attribute_value_length_limit` does (a value can come from a record's field)
    exceptions    recorded as status ERROR with the exception's class name only, never its message (a
                  message can quote a prompt); no exception event
    events, links kept, bounded like attributes (sluice's stages make none)

`observability.recorder = "sdk"` installs the SDK's own tracer instead (its span limits, at its cost);
the stages' spans then carry an exception's class name only too (`pipeline.tracing._StageSpan` keeps
the SDK from recording the exception itself).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, SpanProcessor, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util._decorator import _agnosticcontextmanager

MAX_ATTRIBUTES = 128  # per span, event or link (the SDK's default limit)
MAX_ATTRIBUTE_CHARS = 1024  # per string value, and per string of a sequence (the SDK has no default limit)
MAX_EVENTS = MAX_LINKS = 128
_SCALARS = (str, bool, int, float, bytes)
_PLAIN = frozenset(_SCALARS)  # exact classes, checked by identity: no subclass walks
_CUT = frozenset((str, bytes))  # the values MAX_ATTRIBUTE_CHARS bounds
_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
_bits = random.getrandbits


def _valid(value: Any) -> Any:
    """`value` as an attribute keeps it (a list becomes a tuple, a long string is cut), or None: not an
    OTLP value."""
    if isinstance(value, str | bytes):
        return value[:MAX_ATTRIBUTE_CHARS]
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence) and all(isinstance(v, _SCALARS) for v in value):
        return tuple(v[:MAX_ATTRIBUTE_CHARS] if isinstance(v, str | bytes) else v for v in value)
    return None


def _kept(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    kept = {}
    for key, value in (attributes or {}).items():
        if (valid := _valid(value)) is not None and len(kept) < MAX_ATTRIBUTES:
            kept[key] = valid
    return kept


class LeanSpan(trace.Span):
    """A recorded span; reads like the SDK's ReadableSpan for processors and exporters."""

    events: tuple[Event, ...] | list[Event] = ()
    links: tuple[Link, ...] | list[Link] = ()
    dropped_events = dropped_links = 0

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind, attributes: Mapping[str, Any] | None,
                 start_time: int, processor: SpanProcessor, resource: Resource, scope: InstrumentationScope) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes: dict[str, Any] = {}
        self.dropped_attributes = 0
        self.status = _UNSET
        self.resource = resource
        self.instrumentation_scope = scope
        self._processor = processor
        if attributes:
            for key, value in attributes.items():  # the common case inline: a short scalar, under the limit
                if value.__class__ in _PLAIN and len(self.attributes) < MAX_ATTRIBUTES and (
                        value.__class__ not in _CUT or len(value) <= MAX_ATTRIBUTE_CHARS):
                    self.attributes[key] = value
                else:
                    self.set_attribute(key, value)

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        value = _valid(value)
        if value is None or self.end_time is not None:
            return
        if key in self.attributes or len(self.attributes) < MAX_ATTRIBUTES:
            self.attributes[key] = value
        else:
            self.dropped_attributes += 1

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self.end_time is not None:
            return
        if len(self.events) >= MAX_EVENTS:
            self.dropped_events += 1
            return
        if not self.events:
            self.events = []
        self.events.append(Event(name, _kept(attributes), timestamp or time.time_ns()))  # type: ignore[union-attr]

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.end_time is not None or not context.is_valid:
            return
        if len(self.links) >= MAX_LINKS:
            self.dropped_links += 1
            return
        if not self.links:
            self.links = []
        self.links.append(Link(context, _kept(attributes)))  # type: ignore[union-attr]

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return  # as the SDK: OK is final
        self.status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: int | None = None,
                         escaped: bool = False) -> None:
        self.set_status(Status(StatusCode.ERROR, type(exception).__name__))

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        self._processor.on_end(self)  # type: ignore[arg-type]


class LeanTracer(trace.Tracer):
    def __init__(self, provider: TracerProvider, scope: InstrumentationScope) -> None:
        self._sampler = provider.sampler
        self._resource = provider.resource
        self._processor = provider._active_span_processor
        self._scope = scope

    def start_span(self, name: str, context: context_api.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = (), start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> trace.Span:
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id, state, sampled = parent.trace_id, parent.trace_state, parent.trace_flags.sampled
        else:
            parent, trace_id = None, _bits(128) or 1
            result = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            state, sampled = result.trace_state, result.decision.is_sampled()
        span_context = SpanContext(trace_id, _bits(64) or 1, False, _SAMPLED if sampled else _NOT_SAMPLED, state)
        if not sampled:
            return NonRecordingSpan(span_context)
        span = LeanSpan(name, span_context, parent, kind, attributes, start_time or time.time_ns(), self._processor, self._resource, self._scope)
        for link in links or ():
            span.add_link(link.context, link.attributes)
        self._processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span

    @_agnosticcontextmanager
    def start_as_current_span(self, name: str, context: context_api.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                              attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = (),
                              start_time: int | None = None, record_exception: bool = True, set_status_on_exception: bool = True,
                              end_on_exit: bool = True) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        token = context_api.attach(trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as exc:
            if set_status_on_exception and isinstance(span, LeanSpan) and not isinstance(exc, GeneratorExit):
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            context_api.detach(token)
            if end_on_exit:
                span.end()


class LeanTracerProvider(TracerProvider):
    """The SDK's provider (sampler, resource, span processors, shutdown) handing out LeanTracers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lean: dict[InstrumentationScope, LeanTracer] = {}

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Any = None) -> trace.Tracer:
        scope = InstrumentationScope(instrumenting_module_name or "", instrumenting_library_version or "", schema_url, attributes)
        tracer = self._lean.get(scope)
        if tracer is None:
            tracer = self._lean.setdefault(scope, LeanTracer(self, scope))
        return tracer

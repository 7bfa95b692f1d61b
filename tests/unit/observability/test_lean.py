"""The lean span recorder keeps the API's promises the pipeline relies on: parent-based sampling (a root
asks the sampler, a child follows its parent), the processors see every recorded span end once,
attributes keep OTLP's types within their limit, an exception is recorded by its class name only, and
the spans read like the SDK's for the exporters (the OTLP encoder takes them)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags

from pipeline import tracing
from pipeline.observability.lean import MAX_ATTRIBUTE_CHARS, MAX_ATTRIBUTES, LeanSpan, LeanTracerProvider
from pipeline.observability.otlp import Encoder


def recorder(sampler: Sampler = ALWAYS_ON) -> tuple[trace.Tracer, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = LeanTracerProvider(sampler=ParentBased(sampler), resource=Resource.create({"service.name": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider.get_tracer("sluice"), memory


def remote(sampled: bool) -> trace.Span:
    return trace.NonRecordingSpan(SpanContext(0xABC, 0xDEF, True, TraceFlags(1 if sampled else 0)))


def test_a_child_follows_its_parent_and_a_root_asks_the_sampler() -> None:
    tracer, memory = recorder(ALWAYS_OFF)
    with tracer.start_as_current_span("root") as root:  # the sampler says no
        assert not root.is_recording() and not root.get_span_context().trace_flags.sampled
        with tracer.start_as_current_span("child") as child:
            assert not child.is_recording()
            assert child.get_span_context().trace_id == root.get_span_context().trace_id
    sampled = tracer.start_span("stage", context=trace.set_span_in_context(remote(True)), kind=SpanKind.CONSUMER)
    dropped = tracer.start_span("stage", context=trace.set_span_in_context(remote(False)))
    sampled.end()
    dropped.end()
    [span] = memory.get_finished_spans()
    assert span.parent is not None and span.parent.span_id == 0xDEF and span.parent.is_remote
    assert span.context.trace_id == 0xABC and span.context.span_id not in (0, 0xDEF)
    assert span.kind is SpanKind.CONSUMER and span.context.trace_flags.sampled


def test_the_current_span_nests_and_ends_once() -> None:
    tracer, memory = recorder()
    with tracer.start_as_current_span("outer") as outer:
        with tracer.start_as_current_span("inner") as inner:
            assert trace.get_current_span() is inner
            headers = tracing.inject()
        assert trace.get_current_span() is outer
        inner.end()  # a second end changes nothing
    assert trace.get_current_span() is trace.INVALID_SPAN
    spans = memory.get_finished_spans()
    assert [s.name for s in spans] == ["inner", "outer"]
    assert spans[0].parent.span_id == spans[1].context.span_id
    assert headers == [("traceparent", f"00-{spans[0].context.trace_id:032x}-{spans[0].context.span_id:016x}-01".encode())]
    assert spans[0].end_time >= spans[0].start_time > 0


def test_attributes_keep_otlp_types_within_the_limit() -> None:
    tracer, memory = recorder()
    with tracer.start_as_current_span("s", attributes={"n": 1, "bad": object(), "list": [1, 2]}) as span:
        span.set_attribute("none", None)
        span.set_attribute("strs", ["a", "b"])
        span.set_attribute("mixed", ["a", object()])
        for i in range(MAX_ATTRIBUTES + 5):
            span.set_attribute(f"k{i}", i)
        span.set_attribute("n", 2)  # an existing key may change past the limit
    [done] = memory.get_finished_spans()
    assert done.attributes["n"] == 2 and done.attributes["list"] == (1, 2) and done.attributes["strs"] == ("a", "b")
    assert "bad" not in done.attributes and "none" not in done.attributes and "mixed" not in done.attributes
    # n, list and strs came first: of the k-keys, MAX_ATTRIBUTES - 3 fit, the other 8 are counted dropped
    assert len(done.attributes) == MAX_ATTRIBUTES and done.dropped_attributes == 8


def test_a_long_string_attribute_is_cut_to_the_limit() -> None:
    """A value can come from a record's field (`request.id`): a megabyte id made a megabyte attribute."""
    tracer, memory = recorder()
    long = "x" * 1_000_000
    with tracer.start_as_current_span("s", attributes={"start": long, "short": "t/r1", "raw": b"y" * 5000}) as span:
        span.set_attribute("request.id", long)
        span.set_attribute("list", ["a", long])
        span.add_event("e", {"why": long})
    [done] = memory.get_finished_spans()
    cut = "x" * MAX_ATTRIBUTE_CHARS
    assert done.attributes["start"] == cut and done.attributes["request.id"] == cut
    assert done.attributes["list"] == ("a", cut)
    assert done.attributes["raw"] == b"y" * MAX_ATTRIBUTE_CHARS and done.attributes["short"] == "t/r1"
    assert done.events[0].attributes["why"] == cut


def test_an_exception_is_recorded_by_its_class_name_only() -> None:
    tracer, memory = recorder()
    with pytest.raises(ValueError):
        with tracer.start_as_current_span("s"):
            raise ValueError("the prompt said: my password is hunter2")
    [span] = memory.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "ValueError"
    assert not span.events
    span.set_status(StatusCode.OK)  # ended: nothing changes
    assert span.status.status_code is StatusCode.ERROR


def test_ok_is_final_and_an_ended_span_is_frozen() -> None:
    tracer, _ = recorder()
    span = tracer.start_span("s")
    assert isinstance(span, LeanSpan)
    span.set_status(StatusCode.OK)
    span.set_status(StatusCode.ERROR, "late")
    span.end()
    span.set_attribute("after", 1)
    span.update_name("renamed")
    span.add_event("after")
    assert span.status.status_code is StatusCode.OK and span.attributes == {} and span.name == "s" and not span.events


def test_events_and_links_reach_the_encoder_like_the_sdks() -> None:
    tracer, memory = recorder()
    link = trace.Link(SpanContext(0x1, 0x2, True, TraceFlags(1)), {"why": "batch", "bad": object()})
    with tracer.start_as_current_span("s", links=[link], kind=SpanKind.PRODUCER) as span:
        span.add_event("retry", {"attempt": 2, "bad": object()}, timestamp=123)
    spans = memory.get_finished_spans()
    assert spans[0].links[0].attributes == {"why": "batch"} and spans[0].events[0].attributes == {"attempt": 2}
    assert ExportTraceServiceRequest.FromString(Encoder().encode(spans)) == encode_spans(spans)

"""The spans the runner makes: a CONSUMER span per record continuing the trace in its headers, with
OpenTelemetry's messaging attributes; a PRODUCER span per produced message whose headers carry the trace
on; no span outside a trace; an exception's class name in a span, never its message, with either
recorder; the dashboard's waterfall from recorded spans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pipeline import tracing
from pipeline.observability.lean import LeanTracerProvider
from pipeline.observability.recent import RecentTraces


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = tracing.install()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def record(headers: list[tuple[str, bytes]], topic: str = "llm.admitted") -> SimpleNamespace:
    return SimpleNamespace(topic=topic, partition=3, offset=42, value=b"x" * 10, headers=headers, timestamp=0)


def test_a_stage_continues_the_trace_and_passes_it_on(exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with tracing.tracer.start_as_current_span("client") as root:
        headers = tracing.publish("llm.admitted", span=True)  # the client's send: always a PRODUCER span
    with tracing.consume_span(record(headers), "guard"):
        forwarded = tracing.publish("llm.screened")  # a stage's output: the stage's own span's context
    with tracing.consume_span(record(forwarded, "llm.screened"), "cache"):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"client", "send llm.admitted", "guard", "cache"}
    assert {s.context.trace_id for s in spans.values()} == {root.get_span_context().trace_id}
    guard = spans["guard"]
    assert guard.kind is trace.SpanKind.CONSUMER and guard.parent.span_id == spans["send llm.admitted"].context.span_id
    assert spans["send llm.admitted"].kind is trace.SpanKind.PRODUCER
    assert spans["cache"].parent.span_id == guard.context.span_id
    assert dict(guard.attributes) == {
        "messaging.system": "kafka", "messaging.operation.type": "process",
        "messaging.destination.name": "llm.admitted", "messaging.consumer.group.name": "guard",
        "messaging.destination.partition.id": "3", "messaging.kafka.offset": 42, "messaging.message.body.size": 10,
    }


def test_producer_spans_when_configured(exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracing._options, "producer_spans", True)
    exporter.clear()
    with tracing.consume_span(record([]), "ingest"):
        headers = tracing.publish("llm.admitted")
    with tracing.consume_span(record(headers), "guard"):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["send llm.admitted"].kind is trace.SpanKind.PRODUCER
    assert spans["send llm.admitted"].parent.span_id == spans["ingest"].context.span_id
    assert spans["guard"].parent.span_id == spans["send llm.admitted"].context.span_id


def test_no_span_and_no_headers_outside_a_trace(exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    assert tracing.publish("llm.backend.health") == []
    assert exporter.get_finished_spans() == ()


def test_a_record_without_headers_starts_a_trace(exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with tracing.consume_span(record([]), "ingest"):
        pass
    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.name == "ingest"


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize("recorder", [TracerProvider, LeanTracerProvider], ids=["sdk", "lean"])
@pytest.mark.parametrize("span_of", [lambda: tracing.consume_span(record([]), "guard"),
                                     lambda: tracing.handover_span("llm.admitted", "guard")], ids=["consumed", "handed_over"])
def test_a_span_ended_by_an_exception_keeps_its_class_name_not_its_message(
    recorder: type[TracerProvider], span_of, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception's message can quote a prompt or a key (a decode error quoting its input, a Redis
    error): the span says that it failed and with which class of error, nothing of the message."""
    memory = InMemorySpanExporter()
    provider = recorder()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("sluice"))  # the process's provider is set once
    with pytest.raises(ValueError), span_of():
        raise ValueError(f"Expecting value: line 1 column 1: {{'api_key': '{SECRET}'}}")
    [span] = memory.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "ValueError"
    assert list(span.events) == []
    assert not any(SECRET in str(value) for value in span.attributes.values())
    assert SECRET.encode() not in encode_spans([span]).SerializeToString()  # all that OTLP would carry


def test_waterfall_of_the_last_finished_trace(exporter: InMemorySpanExporter) -> None:
    recent = RecentTraces()
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    provider.add_span_processor(recent)
    with tracing.tracer.start_as_current_span("chat m") as root:
        headers = tracing.publish("llm.requests")
        for stage in ("ingest", "guard"):
            with tracing.consume_span(record(headers), stage):
                headers = tracing.publish("next")
    with tracing.tracer.start_as_current_span("unfinished"):  # a newer trace still open: skipped
        with tracing.consume_span(record(tracing.publish("x")), "ingest"):
            waterfall = recent.waterfall()
    assert waterfall is not None and waterfall["root"] == "chat m" and root.get_span_context().is_valid
    assert [s["stage"] for s in waterfall["stages"]] == ["ingest", "guard"]
    assert all(0 <= s["start_ms"] <= s["end_ms"] <= waterfall["total_ms"] for s in waterfall["stages"])


def test_a_client_span_names_a_configured_model_or_other(exporter: InMemorySpanExporter) -> None:
    from pipeline.observability.watch import RequestWatch
    from tests.unit.helpers import request

    exporter.clear()
    made_up = "sk-sluice-SECRET patient has HIV"  # a model name is the client's text, up to 256 characters
    for rid, model in (("w1", made_up), ("w2", "smollm2-135m-instruct")):
        RequestWatch(request(rid, model=model), models=("smollm2-135m-instruct",)).finish(None)
    spans = {span.attributes["sluice.client.request_id"]: span for span in exporter.get_finished_spans()}
    assert (spans["w1"].name, spans["w1"].attributes["gen_ai.request.model"]) == ("chat other", "other")
    assert spans["w2"].attributes["gen_ai.request.model"] == "smollm2-135m-instruct"
    assert made_up.encode() not in encode_spans([spans["w1"]]).SerializeToString()

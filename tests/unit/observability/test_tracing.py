"""The spans the runner makes: a CONSUMER span per record continuing the trace in its headers, with
OpenTelemetry's messaging attributes; a PRODUCER span per produced message whose headers carry the trace
on; no span outside a trace; an exception's class name in a span, never its message, with either
recorder; the dashboard's waterfall from recorded spans; at ingest, the operator's sampling decision and
no client tracestate, whatever a record on llm.requests asks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pipeline import tracing
from pipeline.observability.config import ObservabilitySettings
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


CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CLIENT_STATE = b"k=" + b"v" * 198  # 200 characters a direct producer would have carried on every hop


def client_headers(flags: str, trace_id: str = CLIENT_TRACE) -> list[tuple[str, bytes]]:
    return [("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-{flags}".encode()), ("tracestate", CLIENT_STATE)]


Installed = tuple[TracerProvider, InMemorySpanExporter]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Installed]]:
    """`tracing.install(ObservabilitySettings(**fields))` as a process runs it, exporting in batches to memory;
    the process's own provider (set once) and tracing's options are put back after the test."""
    providers: list[TracerProvider] = []

    def install(**fields: Any) -> Installed:
        memory = InMemorySpanExporter()
        monkeypatch.setattr(tracing, "_options", dict(tracing._options))
        monkeypatch.setattr(tracing, "tracer", tracing.tracer)
        monkeypatch.setattr(trace, "set_tracer_provider", providers.append)
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: providers[-1])
        tracing.install(ObservabilitySettings(**fields), exporter=memory)
        return providers[-1], memory

    yield install
    for provider in providers:
        provider.shutdown()


def traceparent(headers: list[tuple[str, bytes]]) -> list[str]:
    [value] = [value for key, value in headers if key == "traceparent"]
    return value.decode().split("-")


@pytest.mark.parametrize("recorder", ["lean", "sdk"])
def test_ingest_does_not_follow_a_producers_sampled_flag(installed: Callable[..., Installed], recorder: str) -> None:
    """A tenant allowed to write llm.requests sets `sampled` on every record: with sample_ratio 0 nothing
    is recorded or exported, at ingest or after it, and its tracestate goes no further."""
    provider, memory = installed(sample_ratio=0.0, recorder=recorder)
    with tracing.consume_span(record(client_headers("01"), "llm.requests"), "ingest"):
        headers = tracing.publish("llm.admitted")
    with tracing.consume_span(record(headers), "guard"):
        pass
    provider.force_flush()
    assert memory.get_finished_spans() == ()
    assert [key for key, _ in headers] == ["traceparent"]  # no tracestate
    _, trace_id, _, flags = traceparent(headers)
    assert (trace_id, flags) == (CLIENT_TRACE, "00")  # still the client's trace, not sampled


@pytest.mark.parametrize("recorder", ["lean", "sdk"])
def test_ingest_records_what_the_ratio_draws_in_the_clients_trace(
    installed: Callable[..., Installed], recorder: str,
) -> None:
    """The operator's draw records a request whose client traces nothing, as a child of the client's span
    (its SDK and bridge spans are in that trace), without the client's tracestate."""
    provider, memory = installed(sample_ratio=1.0, recorder=recorder)
    with tracing.consume_span(record(client_headers("00"), "llm.requests"), "ingest"):  # a client that traces nothing
        headers = tracing.publish("llm.admitted")
    provider.force_flush()
    [span] = memory.get_finished_spans()
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    assert len(span.context.trace_state) == 0 and [key for key, _ in headers] == ["traceparent"]
    assert traceparent(headers)[3] == "01"


def test_the_draw_at_ingest_is_not_the_clients_trace_id(installed: Callable[..., Installed]) -> None:
    """A ratio sampler decides by the trace id: ingest draws one of its own, so no trace id a client picks
    (the lowest, which that sampler always keeps, or the highest, never) decides the outcome."""
    provider, memory = installed(sample_ratio=0.5)
    for trace_id in ("1" + "0" * 31, "0" * 16 + "f" * 16):
        memory.clear()
        for _ in range(100):
            with tracing.consume_span(record(client_headers("01", trace_id), "llm.requests"), "ingest"):
                pass
        provider.force_flush()
        assert 0 < len(memory.get_finished_spans()) < 100


def test_a_later_stage_follows_the_context_it_receives(installed: Callable[..., Installed]) -> None:
    """Past ingest, every hop is sluice's own: the flag and the tracestate are followed as they come."""
    provider, memory = installed(sample_ratio=0.0)
    with tracing.consume_span(record(client_headers("01"), "llm.admitted"), "guard"):
        headers = tracing.publish("llm.screened")
    provider.force_flush()
    [span] = memory.get_finished_spans()
    assert span.context.trace_state.to_header().encode() == CLIENT_STATE
    assert dict(headers)["tracestate"] == CLIENT_STATE


def test_trusted_inbound_context_is_followed_at_ingest(installed: Callable[..., Installed]) -> None:
    provider, memory = installed(sample_ratio=0.0, trust_inbound_context=True)
    with tracing.consume_span(record(client_headers("01"), "llm.requests"), "ingest"):
        headers = tracing.publish("llm.admitted")
    provider.force_flush()
    [span] = memory.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == CLIENT_TRACE and dict(headers)["tracestate"] == CLIENT_STATE

"""sluice's OTLP encoder writes what the SDK's encoder writes: its bytes, parsed by the official protobuf
classes, equal the SDK's message for spans with every kind of attribute, events, links, a remote
parent, trace state and an error status; and the exporter POSTs them as OTLP/HTTP expects."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from pipeline.observability.otlp import Encoder, OtlpHttpExporter
from tests.ports import free_port


def sdk_spans() -> list:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "sluice", "host.cores": 2}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("sluice", "0.1.0")
    other = provider.get_tracer("another.scope")
    remote = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "x1"), ("other", "y")]))
    with tracer.start_as_current_span("chat m", kind=SpanKind.CLIENT, attributes={
        "s": "text é", "b": True, "f": False, "i": 7, "neg": -3, "big": 2**62, "d": 0.25, "strs": ["a", "b"], "ints": [1, -2],
        "bools": [True, False], "floats": [1.5], "empty": "",
    }) as root:
        root.add_event("retry", {"attempt": 2})
        root.add_event("bare")
        with tracer.start_as_current_span("route", kind=SpanKind.CONSUMER, links=[Link(remote, {"why": "batch"})]) as child:
            child.set_status(Status(StatusCode.ERROR, "InfraUnavailable"))
    with tracer.start_span("emit", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)), kind=SpanKind.CONSUMER) as s:
        s.set_status(StatusCode.OK)
    with other.start_span("elsewhere", kind=SpanKind.PRODUCER):
        pass
    with tracer.start_span(""):
        pass
    return list(memory.get_finished_spans())


def test_the_encoding_parses_to_the_sdk_encoders_message() -> None:
    spans = sdk_spans()
    ours = ExportTraceServiceRequest.FromString(Encoder().encode(spans))
    assert ours == encode_spans(spans)
    assert len([s for rs in ours.resource_spans for ss in rs.scope_spans for s in ss.spans]) == len(spans)


def test_an_encoder_reused_across_batches_stays_exact() -> None:
    encoder = Encoder()
    spans = sdk_spans()
    for batch in (spans[:2], spans[2:], spans):
        assert ExportTraceServiceRequest.FromString(encoder.encode(batch)) == encode_spans(batch)


def test_a_value_with_no_otlp_form_is_refused() -> None:
    span = sdk_spans()[0]
    span._attributes = {"obj": object()}  # the SDK never lets one in; the encoder says so if one comes
    with pytest.raises(TypeError, match="object"):
        Encoder().encode([span])


@pytest.fixture
def sink() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    received: list[tuple[str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            received.append((self.headers["content-type"], self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_the_exporter_posts_protobuf_on_one_connection(sink: tuple[str, list[tuple[str, bytes]]]) -> None:
    base, received = sink
    exporter = OtlpHttpExporter(base + "/v1/traces")
    spans = sdk_spans()
    assert exporter.export(spans[:3]) is SpanExportResult.SUCCESS
    assert exporter.export(spans[3:]) is SpanExportResult.SUCCESS
    assert [kind for kind, _ in received] == ["application/x-protobuf"] * 2
    assert ExportTraceServiceRequest.FromString(received[1][1]) == encode_spans(spans[3:])
    exporter.shutdown()
    elsewhere = OtlpHttpExporter(base + "/elsewhere")
    assert elsewhere.export(spans) is SpanExportResult.FAILURE  # a 404 is a failure
    elsewhere.shutdown()


def test_an_unreachable_endpoint_is_a_failure_not_an_exception() -> None:
    with socket_closed_port() as port:
        assert OtlpHttpExporter(f"http://127.0.0.1:{port}/v1/traces", timeout_s=1).export(sdk_spans()) is SpanExportResult.FAILURE


def test_only_http_urls_are_endpoints() -> None:
    for bad in ("file:///etc/passwd", "127.0.0.1:4318", "http://"):
        with pytest.raises(ValueError):
            OtlpHttpExporter(bad)


class socket_closed_port:
    """A port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        return free_port()  # below the ephemeral range: no outgoing connection takes it meanwhile

    def __exit__(self, *exc: object) -> None:
        pass

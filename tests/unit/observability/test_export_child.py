"""The export child posts exactly what the in-process exporter posts: spans flattened, pickled and
encoded in the child give the same bytes as encoding the spans themselves (the SDK's spans and the lean
recorder's), and the SDK's encoder's message; the child runs at a lower priority; a flush waits for the
child's posts; a dead child is replaced; a child whose parent dies exits."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pipeline.observability import export_child
from pipeline.observability.export_child import ROOT, ChildExporter
from pipeline.observability.lean import LeanTracerProvider
from pipeline.observability.otlp import Encoder, flatten
from tests.unit.observability.test_otlp import sdk_spans, sink  # noqa: F401 (a fixture)


def lean_spans() -> list:
    memory = InMemorySpanExporter()
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "sluice"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("sluice")
    with tracer.start_as_current_span("ingest", kind=SpanKind.CONSUMER, attributes={"messaging.kafka.offset": 12, "x": "y"}):
        with tracer.start_as_current_span("route", kind=SpanKind.CONSUMER) as child:
            child.set_attribute("outcome", "ok")
    return list(memory.get_finished_spans())


def through_the_pipe(spans: list) -> bytes:
    """What the child posts for `spans`: flattened, pickled, unpickled and encoded."""
    origins: dict = {}
    return Encoder().encode_flat(pickle.loads(pickle.dumps([flatten(s, origins) for s in spans], protocol=pickle.HIGHEST_PROTOCOL)))


def test_spans_through_the_pipe_encode_to_the_same_bytes() -> None:
    for spans in (sdk_spans(), lean_spans()):
        assert through_the_pipe(spans) == Encoder().encode(spans)
        assert ExportTraceServiceRequest.FromString(through_the_pipe(spans)) == encode_spans(spans)


def test_the_child_posts_each_batch_and_a_flush_waits_for_it(sink: tuple[str, list[tuple[str, bytes]]],  # noqa: F811
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_child, "RESTART_S", 0.0)
    base, received = sink
    exporter = ChildExporter(base + "/v1/traces")
    spans = sdk_spans()
    try:
        assert exporter.export(spans[:3]) is SpanExportResult.SUCCESS
        assert exporter.export(spans[3:]) is SpanExportResult.SUCCESS
        assert exporter.force_flush(10_000)
        assert [kind for kind, _ in received] == ["application/x-protobuf"] * 2
        assert ExportTraceServiceRequest.FromString(received[0][1]) == encode_spans(spans[:3])
        assert ExportTraceServiceRequest.FromString(received[1][1]) == encode_spans(spans[3:])
        first = exporter.pid
        assert first is not None
        assert os.getpriority(os.PRIO_PROCESS, first) == min(os.getpriority(os.PRIO_PROCESS, 0) + export_child.NICE, 19)  # background work
        os.kill(first, 9)
        while _state(first) not in ("Z", "gone"):  # dead (Popen reaps it when the exporter next looks)
            time.sleep(0.05)
        assert exporter.export(spans) is SpanExportResult.SUCCESS  # a new child takes it
        assert exporter.force_flush(10_000)
        assert exporter.pid not in (None, first)
        assert ExportTraceServiceRequest.FromString(received[2][1]) == encode_spans(spans)
    finally:
        exporter.shutdown()
    assert exporter.pid is None


def test_a_child_that_cannot_start_is_not_started_again_per_batch(sink: tuple[str, list[tuple[str, bytes]]]) -> None:  # noqa: F811
    base, _ = sink
    exporter = ChildExporter(base + "/v1/traces")
    exporter._argv = [sys.executable, "-c", "import sys; sys.exit(3)"]  # as a child whose imports fail would
    try:
        exporter.export(lean_spans())  # starts it; whether this write lands before it exits is a race
        first = exporter.pid
        assert first is not None
        while _state(first) not in ("Z", "gone"):
            time.sleep(0.05)
        for _ in range(3):  # within RESTART_S of the start: dropped, no new interpreter
            assert exporter.export(lean_spans()) is SpanExportResult.FAILURE
            assert exporter.pid is None
    finally:
        exporter.shutdown()


def test_a_child_exits_when_its_parent_dies(sink: tuple[str, list[tuple[str, bytes]]]) -> None:  # noqa: F811
    base, _ = sink
    script = (
        "import os, sys\n"
        "from pipeline.observability.export_child import ChildExporter\n"
        "from tests.unit.observability.test_export_child import lean_spans\n"
        f"e = ChildExporter({base + '/v1/traces'!r})\n"
        "e.export(lean_spans()); e.force_flush(10_000)\n"
        "print(e.pid, flush=True)\n"
        "os._exit(0)\n"  # no shutdown, no atexit: as if killed
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _state(child) not in ("Z", "gone"):
        time.sleep(0.1)
    assert _state(child) in ("Z", "gone")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0]
    except OSError:
        return "gone"

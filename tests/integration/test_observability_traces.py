"""One request through the real stack (every stage on the real broker and model) is one connected trace:
the client's root span and its PRODUCER send span, then every stage's CONSUMER span in pipeline order, each
a child of the span whose context the message's headers carried; messaging attributes on each; no prompt text or
credential in any attribute. Spans are exported through the real batch processor to an in-memory exporter."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import assemble, tracing
from pipeline.observability.config import ObservabilitySettings
from pipeline.sdk import Client
from pipeline.settings import Settings
from pipeline.topology import HANDOVER
from tests.integration.conftest import Bridge

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET_KEY = "sk-not-a-real-key-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    """The process's tracer provider with an in-memory exporter behind a batch processor (as in production)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):  # another test installed one: export from it too
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    else:
        provider = tracing.install(ObservabilitySettings(export_delay_ms=100), exporter=exporter)
    yield exporter, provider


def stage_order(settings: Settings) -> list[str]:
    return [node.name for node in assemble.nodes_of(settings)]


async def trace_of(exporter: InMemorySpanExporter, provider: TracerProvider, last_stage: str,
                   predicate=None) -> list[ReadableSpan]:
    """The spans of the trace whose root matches, once its last stage's span has been exported."""
    mine: list[ReadableSpan] = []
    for _ in range(300):  # 30 s: a loaded machine
        provider.force_flush()
        finished = exporter.get_finished_spans()
        roots = [s for s in finished if s.parent is None and (predicate is None or predicate(s))]
        if roots:
            trace_id = roots[-1].context.trace_id
            mine = [s for s in finished if s.context.trace_id == trace_id]
            ids = {s.context.span_id for s in mine}
            if any(s.name == last_stage for s in mine) and all(s.parent is None or s.parent.span_id in ids for s in mine):
                return mine  # complete: a span ends after the messages it produced, so parents come last
        await asyncio.sleep(0.1)
    ids = {s.context.span_id for s in mine}
    raise AssertionError("the request's trace never reached its last stage, or stayed in pieces: "
                         f"{sorted((s.name, s.parent is None or s.parent.span_id in ids) for s in mine)}")


def check_connected(spans: list[ReadableSpan], order: list[str], prompt: str) -> None:
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1, [s.name for s in roots]
    for s in spans:  # every span's parent is in the trace: one connected tree
        assert s.parent is None or s.parent.span_id in ids, s.name
    by_id = {s.context.span_id: s for s in spans}
    consumers = [s for s in spans if s.kind is trace.SpanKind.CONSUMER]
    assert {s.name for s in consumers} == set(order)
    # The path of the terminal event: emit's last span, and its ancestors back to the root, pass every
    # stage once in pipeline order (the first chunk takes a shortcut: prefill sends it to postguard
    # before decode starts, so start times alone do not give the order).
    node, path = max((s for s in consumers if s.name == order[-1]), key=lambda s: s.end_time), []
    while node is not None:
        if node.kind is trace.SpanKind.CONSUMER:
            path.append(node.name)
        node = by_id[node.parent.span_id] if node.parent is not None else None
    assert path[::-1] == order, f"the terminal event's path: {path[::-1]}; pipeline: {order}"
    for s in consumers:
        attrs = s.attributes or {}
        assert attrs["messaging.system"] == "kafka"
        assert attrs["messaging.consumer.group.name"] == s.name
        assert attrs["messaging.destination.name"].startswith("llm.")
        if attrs.get("sluice.handover"):  # handed over in memory by the stage before, in the same process
            assert s.name in HANDOVER and "messaging.kafka.offset" not in attrs
        else:
            assert isinstance(attrs["messaging.kafka.offset"], int)
            assert attrs["messaging.destination.partition.id"].isdigit()
        parent = by_id[s.parent.span_id]  # the stage before (or the client's send span)
        assert parent.kind is trace.SpanKind.CONSUMER or parent.name == f"send {attrs['messaging.destination.name']}"
    for s in spans:
        for value in (s.attributes or {}).values():
            text = str(value)
            assert prompt not in text and SECRET_KEY not in text, (s.name, text)


async def test_sdk_request_is_one_trace_in_pipeline_order(stack: Settings, spans) -> None:
    exporter, provider = spans
    prompt = f"Name one colour. ({uuid.uuid4().hex[:6]})"
    async with Client(stack) as client:
        request = client.request(messages=[{"role": "user", "content": prompt}], max_tokens=4, no_cache=True)
        await client.complete(request)
    order = stage_order(stack)
    found = await trace_of(exporter, provider, order[-1],
                           lambda s: (s.attributes or {}).get("sluice.client.request_id") == request.id)
    root = next(s for s in found if s.parent is None)
    assert root.kind is trace.SpanKind.CLIENT and root.name.startswith("chat ")
    check_connected(found, order, prompt)
    handed = {s.name for s in found if (s.attributes or {}).get("sluice.handover")}
    assert handed == set(order) & HANDOVER  # the stack runs as `sluice run` does: route and co. take in memory


async def test_bridge_request_trace_is_rooted_at_its_http_span(bridge: Bridge, spans) -> None:
    exporter, provider = spans
    prompt = f"Name one animal. ({uuid.uuid4().hex[:6]})"
    started = time.time_ns()
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        reply = await http.post("/v1/chat/completions", headers={"cache-control": "no-cache", "authorization": f"Bearer {SECRET_KEY}"},
                                json={"model": bridge.settings.models[0], "max_tokens": 4,
                                      "messages": [{"role": "user", "content": prompt}]})
    assert reply.status_code == 200, reply.text
    order = stage_order(bridge.settings)
    found = await trace_of(exporter, provider, order[-1],
                           lambda s: s.kind is trace.SpanKind.SERVER and s.start_time >= started)
    root = next(s for s in found if s.parent is None)
    assert root.name == "POST /v1/chat/completions" and root.attributes["http.response.status_code"] == 200
    check_connected(found, order, prompt)

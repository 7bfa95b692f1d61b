"""The wire schemas bound what a record on an internal topic can carry into logs, spans, usage records and
metric labels (topics.hops: `RequestId`, `Timings`; topics.stream: `RateLimit`, `Failed.nonce`): every id
and timing the pipeline makes fits, and a forged record past them is unreadable, dead-lettered by the
runner like any schema error, without a reply, a span attribute or a metric series of its own."""

from __future__ import annotations

import re
import sys
import unicodedata
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import metrics
from pipeline.gateway.gateway import refused
from pipeline.gateway.keys import tenant_name
from pipeline.gateway.limits import Refusal, Scope
from pipeline.handling import Handling, _nonce
from pipeline.stages.emit import EmitStage
from pipeline.state import MemoryStateStore
from pipeline.topology import graph
from tests.unit.fakes import InstantAcks
from tests.unit.helpers import SETTINGS, admitted, node, request
from topics import codec, registry
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import MAX_REQUEST_ID_CHARS, MAX_TIMINGS, REQUEST_ID, Admitted, request_key
from topics.stream import Chunk, Done, Failed, FinishReason, RateLimit, StreamEvent, Usage
from topics.usage import UsageRecord

REPLY = registry.reply_topic("sdk")
LONGEST_TENANT = "租户-é.ü_x" * 16  # 128 printable characters, not all ASCII, as a key or a JWT may name
LONGEST = request_key(LONGEST_TENANT, "C" * 64)  # 128 + 1 + 64


def failed(rid: str, **fields: Any) -> Failed:
    return Failed(id=rid, reply_to=REPLY, code=ErrorCode.internal, message="m", retriable=True, tenant="t", model="m",
                  created_at=1.0, **fields)


def done(rid: str, **fields: Any) -> Done:
    return Done(id=rid, reply_to=REPLY, chunks=0, digest="d", finish_reason=FinishReason.stop, usage=Usage(), tenant="t",
                model="m", created_at=1.0, **fields)


def carriers(rid: str) -> list[tuple[Any, Any]]:
    """One message of each wire type with a request id, under `rid`, and the type it is read as."""
    hop = Admitted(id=rid, request=request("r1"), tenant="t", principal="anonymous", admitted_at=1.0)
    usage = UsageRecord(id=rid, tenant="t", model="m", outcome="done", prompt_tokens=0, completion_tokens=0, total_ms=1.0,
                        timings={}, at=1.0)
    return [(Chunk(id=rid, reply_to=REPLY, seq=0, text="x", tenant="t"), StreamEvent), (done(rid), StreamEvent),
            (failed(rid), StreamEvent), (hop, Admitted), (Cancel(id=rid, reason=CancelReason.deadline, at=1.0), Cancel),
            (usage, UsageRecord)]


@pytest.mark.parametrize("rid", [
    LONGEST, "default/" + "a" * 64, request_key("acme", "0f8fad5bd9cb469fa16570867728950e"),  # the SDK's uuid4().hex
    "r1", "C" * 64,  # a client's bare id: a refusal before ingest namespaced it, a cancel by the client's id
])
def test_every_id_the_pipeline_makes_fits(rid: str) -> None:
    assert len(LONGEST) == MAX_REQUEST_ID_CHARS
    for message, type_ in carriers(rid):
        assert codec.decode(codec.encode(message), type_) == message


def test_an_id_ingest_mints_from_a_real_request_fits() -> None:
    hop = admitted(request("batch-line_0007:retry.2"), tenant=LONGEST_TENANT)
    assert codec.decode(codec.encode(hop), Admitted) == hop


@pytest.mark.parametrize("rid", [
    "t/x\nFORGED LOG LINE", "t/x\r\nstage=emit request=t/y", "t/x\x1b[2J", "t\u202e/x", "t\u200b/x", "t/x y", "t /x",
    "t/x/y", "", "t/", "/x", "t/" + "a" * 65, "t" * 129 + "/x", "t/" + "a" * 1_000_000,
])
def test_a_forged_id_is_unreadable_on_every_wire_type(rid: str) -> None:
    for message, type_ in carriers(rid):
        with pytest.raises(codec.SchemaError):
            codec.decode(codec.encode(message), type_)


def test_the_id_rule_admits_every_tenant_a_key_or_a_jwt_may_name_and_no_invisible_character() -> None:
    rule = re.compile(REQUEST_ID)
    for point in range(sys.maxunicode + 1):
        if 0xD800 <= point < 0xE000:  # surrogates: not in valid UTF-8, msgspec refuses them
            continue
        char = chr(point)
        if tenant_name(char):
            assert rule.search(f"{char}/x"), hex(point)
        elif unicodedata.category(char) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            assert not rule.search(f"{char}/x"), hex(point)


def test_a_refusals_nonce_fits_and_a_forged_one_does_not() -> None:
    nonce = _nonce(ConsumerRecord(registry.REQUESTS, 11, 2**62, 0, 0, None, b"{}", None, 0, 2, []))
    assert nonce is not None
    message = failed("r1", nonce=nonce)
    assert codec.decode(codec.encode(message), StreamEvent) == message
    for forged in ("n\nFORGED", "n" * 65, ""):
        with pytest.raises(codec.SchemaError):
            codec.decode(codec.encode(failed("r1", nonce=forged)), StreamEvent)


def test_every_rate_limit_the_gateway_makes_fits() -> None:
    for kind in ("key", "tenant", "ip", "global"):
        for resource in ("requests", "tokens"):
            error = refused(Refusal(Scope(kind, "n"), resource, 10.0, 0, 1.5), 10, 10)  # type: ignore[arg-type]
            assert error.rate_limit is not None
            message = failed("t/r1", rate_limit=error.rate_limit)
            assert codec.decode(codec.encode(message), StreamEvent) == message


@pytest.mark.parametrize(("scope", "resource"), [("scope-17", "tokens"), ("key", "budget"), ("key\n", "requests")])
def test_a_rate_limit_naming_no_scope_or_resource_of_the_gateway_is_unreadable(scope: str, resource: str) -> None:
    message = failed("t/r1", rate_limit=RateLimit(scope, resource, 1, 0, 1.0))  # type: ignore[arg-type]
    with pytest.raises(codec.SchemaError):
        codec.decode(codec.encode(message), StreamEvent)


def test_every_stage_name_fits_the_timings() -> None:
    pool = "p" + "-" * 47  # the longest pool name registry allows
    nodes = graph(("ingest", "guard", "cache", "route", "prefill", "decode", "postguard", "emit"), (pool, "u"), frozenset({"u"}))
    timings = {n.name: 1.0 for n in nodes} | {kind: 1.0 for kind in ("prefill", "decode", "generate")} | {"total": 2.0}
    assert len(timings) <= MAX_TIMINGS
    for message, type_ in ((done("t/r1", timings=timings), StreamEvent), (failed("t/r1", timings=timings), StreamEvent)):
        assert codec.decode(codec.encode(message), type_) == message


@pytest.mark.parametrize("timings", [
    {f"s{i}": 1.0 for i in range(MAX_TIMINGS + 1)}, {"x" * 65: 1.0}, {"": 1.0}, {"decode": 1.0, "x" * 1_000_000: 1.0},
])
def test_timings_past_their_bound_are_unreadable(timings: dict[str, float]) -> None:
    hop = Admitted(id="t/r1", request=request("r1"), tenant="t", principal="anonymous", admitted_at=1.0, timings=timings)
    usage = UsageRecord(id="t/r1", tenant="t", model="m", outcome="done", prompt_tokens=0, completion_tokens=0,
                        total_ms=1.0, timings=timings, at=1.0)
    for message, type_ in ((done("t/r1", timings=timings), StreamEvent), (failed("t/r1", timings=timings), StreamEvent),
                           (hop, Admitted), (usage, UsageRecord)):
        with pytest.raises(codec.SchemaError):
            codec.decode(codec.encode(message), type_)



def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr("pipeline.tracing.tracer", provider.get_tracer("test"))
    return memory


def request_ids(memory: InMemorySpanExporter) -> list[object]:
    found: list[ReadableSpan] = list(memory.get_finished_spans())
    return [s.attributes.get("request.id") for s in found if s.attributes and "request.id" in s.attributes]


@pytest.mark.asyncio
async def test_the_runner_dead_letters_a_forged_event_it_would_have_delivered_and_logged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Failed on llm.checked under a forged id (a line break, a megabyte) reaches neither the client, nor
    a span, nor a log line: emit's runner cannot read it and dead-letters it."""
    memory = spans(monkeypatch)
    producer = InstantAcks()
    run = Handling(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), SETTINGS, producer)  # type: ignore[arg-type]
    for offset, rid in enumerate(("t/x\nstage=emit request=t/y failed: forged", "t/" + "x" * 1_000_000)):
        value = codec.encode(failed(rid))
        record = ConsumerRecord(registry.CHECKED, 0, offset, 0, 0, b"k", value, None, 1, len(value), [])
        assert await run.process(record, None) == "invalid"
    assert [topic for topic, _ in producer.sent] == [registry.DLQ, registry.DLQ]  # no reply, no usage record
    assert request_ids(memory) == []


@pytest.mark.asyncio
async def test_a_thousand_forged_scopes_make_no_rate_limit_series() -> None:
    """emit counts every rate-limit refusal it delivers by scope and resource: forged ones, each naming a
    scope of its own, made a series each."""
    def series() -> int:
        return sum(1 for family in metrics.RATE_LIMITED.collect() for s in family.samples if s.name.endswith("_total"))

    before = series()
    producer = InstantAcks()
    run = Handling(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), SETTINGS, producer)  # type: ignore[arg-type]
    for offset in range(1000):
        limit = RateLimit(f"scope-{offset}", "requests", 1, 0, 1.0)  # type: ignore[arg-type]
        value = codec.encode(Failed(id=f"t/r{offset}", reply_to=REPLY, code=ErrorCode.rate_limited, message="slow down",
                                    retriable=True, tenant="t", model="m", created_at=1.0, rate_limit=limit))
        record = ConsumerRecord(registry.CHECKED, 0, offset, 0, 0, b"k", value, None, 1, len(value), [])
        assert await run.process(record, None) == "invalid"
    assert series() == before


def test_a_timing_key_past_its_bound_is_named_by_where_it_is_never_by_what_it_says() -> None:
    payload = codec.encode(done("t/r1", timings={"sk_SECRET_" * 10: 1.0}))
    with pytest.raises(codec.SchemaError) as caught:
        codec.decode(payload, StreamEvent)
    assert str(caught.value) == "Expected `str` of length <= 64 - at `$.timings[key]`"

"""prefill and decode over a scripted backend: numbering, terminal events, cancellation."""

import asyncio
import time

import pytest

from pipeline.stages.decode import DecodeStage
from pipeline.stages.generation import digest
from pipeline.stages.prefill import PrefillStage
from tests.unit.fakes import ScriptedBackend, run_handler
from tests.unit.helpers import request, routed
from topics import registry
from topics.control import Cancel, CancelReason
from topics.envelope import Envelope
from topics.errors import ErrorCode
from topics.requests import Sampling
from topics.stream import Chunk, Done, Failed

WORDS = ["Hello", " there", ",", " friend", "."]


async def prefill_then_decode(backend: ScriptedBackend, req_overrides: dict[str, object] | None = None) -> list[object]:
    outs = await run_handler(PrefillStage(backend, "local"), routed(request(**(req_overrides or {}))))
    forwarded = [o.value for o in outs if o.topic == registry.PREFILLED]
    events = [o.value for o in outs if o.topic == registry.TOKENS]
    for envelope in forwarded:
        events += [o.value for o in await run_handler(DecodeStage(backend), envelope)]
    return events


@pytest.mark.asyncio
async def test_prefill_sends_the_first_token_and_a_handle() -> None:
    outs = await run_handler(PrefillStage(ScriptedBackend(WORDS), "local"), routed(request()))
    assert [o.topic for o in outs] == [registry.TOKENS, registry.PREFILLED]
    assert outs[0].value == Chunk(id="r1", reply_to="llm.responses.sdk", seq=0, text="Hello")
    envelope = outs[1].value
    assert isinstance(envelope, Envelope) and envelope.prefill is not None
    assert envelope.prefill.handle == "h-r1" and "prefill" in envelope.timings


@pytest.mark.asyncio
async def test_chunks_are_numbered_without_gaps_and_end_in_one_done() -> None:
    events = await prefill_then_decode(ScriptedBackend(WORDS))
    chunks, terminal = events[:-1], events[-1]
    assert [c.seq for c in chunks] == list(range(len(WORDS)))
    assert isinstance(terminal, Done)
    assert terminal.chunks == len(WORDS) and terminal.finish_reason == "stop"
    assert terminal.digest == digest(WORDS)
    assert terminal.usage.completion_tokens == len(WORDS)
    assert set(terminal.timings) >= {"ingest", "prefill", "decode"}


@pytest.mark.asyncio
async def test_max_tokens_ends_with_length() -> None:
    events = await prefill_then_decode(ScriptedBackend(WORDS), {"sampling": Sampling(max_tokens=3)})
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 3


@pytest.mark.asyncio
async def test_a_first_token_that_ends_the_request_skips_decode() -> None:
    outs = await run_handler(PrefillStage(ScriptedBackend(WORDS), "local"), routed(request(sampling=Sampling(max_tokens=1))))
    assert [type(o.value) for o in outs] == [Chunk, Done]


@pytest.mark.asyncio
async def test_a_cancellation_stops_decode_within_a_step() -> None:
    backend = ScriptedBackend(WORDS * 20, step_s=0.01)
    stage = DecodeStage(backend)
    [_, forward] = await run_handler(PrefillStage(backend, "local"), routed(request(sampling=Sampling(max_tokens=100))))
    events: list[object] = []

    async def consume() -> None:
        async for out in stage.handle(forward.value):
            events.append(out.value)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    await stage.on_control(Cancel(id="r1", reason=CancelReason.client_gone, at=time.time()))
    await task
    steps_at_cancel = backend.steps["r1"]
    assert isinstance(events[-1], Failed) and events[-1].code is ErrorCode.cancelled
    assert events[-1].chunks == len(events) - 1 + 1  # the prefill chunk plus decode's
    assert steps_at_cancel < 100 - 1
    assert sum(isinstance(e, Failed | Done) for e in events) == 1


@pytest.mark.asyncio
async def test_a_cancellation_that_arrives_before_decode_is_honoured() -> None:
    backend = ScriptedBackend(WORDS)
    stage = DecodeStage(backend)
    [_, forward] = await run_handler(PrefillStage(backend, "local"), routed(request()))
    await stage.on_control(Cancel(id="r1", reason=CancelReason.output_guard, at=time.time()))
    [out] = await run_handler(stage, forward.value)
    assert isinstance(out.value, Failed) and out.value.code is ErrorCode.content_filter
    assert "r1" not in backend.steps


def test_an_unseeded_request_samples_reproducibly_by_its_id() -> None:
    from pipeline.stages.generation import generation_request

    first, again, other = generation_request(request("a")), generation_request(request("a")), generation_request(request("b"))
    assert first.seed is not None and first.seed == again.seed != other.seed
    assert generation_request(request("a", sampling=Sampling(seed=7))).seed == 7

"""Tokens produced close together travel as one chunk: the merging itself, and decode sending a
non-streaming answer as one chunk and a streaming one with its first token alone."""

import asyncio
from collections.abc import AsyncIterator

import pytest

from pipeline.backends.base import Delta
from pipeline.backends.errors import ModelError
from pipeline.stages import coalesce
from pipeline.stages.coalesce import coalesced
from tests.unit.fakes import ScriptedBackend, run_handler
from tests.unit.test_generation_stages import decode_stage, prefilled
from topics.stream import Chunk, Done

pytestmark = pytest.mark.asyncio


async def deltas(n: int, step_s: float = 0.0, fail_at: int | None = None) -> AsyncIterator[Delta]:
    for i in range(n):
        if step_s:
            await asyncio.sleep(step_s)
        if i == fail_at:
            raise ModelError("upstream failed")
        yield Delta(f"t{i} ", (i,), "length" if i == n - 1 else None)


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


async def test_a_fast_non_streaming_answer_is_one_delta_with_every_token() -> None:
    [one] = await collect(coalesced(deltas(16), streaming=False, first_alone=True))
    assert one.text == "".join(f"t{i} " for i in range(16))
    assert one.token_ids == tuple(range(16)) and one.finish_reason == "length"


async def test_a_streaming_answer_sends_its_first_token_alone_and_merges_the_rest() -> None:
    out = await collect(coalesced(deltas(16), streaming=True, first_alone=True))
    assert [d.text for d in out] == ["t0 ", "".join(f"t{i} " for i in range(1, 16))]
    assert out[-1].finish_reason == "length"


async def test_tokens_slower_than_the_window_each_go_alone() -> None:
    out = await collect(coalesced(deltas(5, step_s=0.03), streaming=True, first_alone=False, window_s=0.005))
    assert [d.token_ids for d in out] == [(i,) for i in range(5)]


async def test_a_window_of_zero_passes_every_delta_through() -> None:
    out = await collect(coalesced(deltas(6), streaming=False, first_alone=False, window_s=0))
    assert len(out) == 6


async def test_a_chunk_never_grows_past_the_size_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalesce, "MAX_CHUNK_CHARS", 10)
    out = await collect(coalesced(deltas(12), streaming=False, first_alone=False))
    assert all(len(d.text) <= 10 + len("t11 ") for d in out) and len(out) > 1
    assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(12))


async def test_text_before_a_backend_failure_is_sent_then_the_failure() -> None:
    got: list[Delta] = []
    with pytest.raises(ModelError):
        async for d in coalesced(deltas(10, fail_at=4), streaming=False, first_alone=False):
            got.append(d)
    assert "".join(d.text for d in got) == "t0 t1 t2 t3 "


async def test_every_backend_step_runs_in_one_task_however_the_chunks_fall() -> None:
    """The backend is read ahead in one task (not one task per delta): cheap when its deltas are at hand,
    and a step that spans a wait (an upstream's read under a timeout scope) stays in the task it began in."""
    tasks: list[asyncio.Task[object] | None] = []

    async def recorded() -> AsyncIterator[Delta]:
        for i in range(9):
            tasks.append(asyncio.current_task())
            if i % 3 == 2:
                await asyncio.sleep(0.02)  # past the window: the chunk goes without this delta
            yield Delta(f"t{i} ", (i,), "length" if i == 8 else None)

    out = await collect(coalesced(recorded(), streaming=True, first_alone=True, window_s=0.005))
    assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(9)) and len(out) > 2
    assert len({id(t) for t in tasks}) == 1


async def test_a_stalled_sender_gets_the_chunks_a_quick_one_gets() -> None:
    """Chunks split where the backend paused, not where the sender came back: a retry after a failed
    send regenerates the same chunks, so emit (which takes a chunk by seq) cannot mix two attempts.
    The backend runs on its own, as the engine does, and queues its deltas: three at once, then a pause."""

    async def engine_like() -> AsyncIterator[Delta]:
        queue: asyncio.Queue[Delta] = asyncio.Queue()

        async def produce() -> None:
            for i in range(12):
                if i and i % 3 == 0:
                    await asyncio.sleep(0.03)
                queue.put_nowait(Delta(f"t{i} ", (i,), "stop" if i == 11 else None))

        producer = asyncio.ensure_future(produce())
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finish_reason:
                    return
        finally:
            producer.cancel()

    async def chunks(stall_s: float) -> list[str]:
        out = []
        async for delta in coalesced(engine_like(), streaming=True, first_alone=False, window_s=0.01):
            out.append(delta.text)
            if len(out) == 1:
                await asyncio.sleep(stall_s)  # the send blocks: the broker is away, the deltas pile up
        return out

    quick, stalled = await chunks(0.0), await chunks(0.2)
    assert quick == ["t0 t1 t2 ", "t3 t4 t5 ", "t6 t7 t8 ", "t9 t10 t11 "]
    assert stalled == quick


async def test_decode_sends_a_non_streaming_answer_as_one_chunk() -> None:
    backend = ScriptedBackend(["a", "b", "c", "d", "e", "f"])
    handed = await prefilled(backend, stream=False)
    outs = [o.value for o in await run_handler(decode_stage(backend, window_s=0.005), handed)]
    chunks = [o for o in outs if isinstance(o, Chunk)]
    assert [c.text for c in chunks] == ["bcdef"] and chunks[0].seq == 1  # prefill sent chunk 0
    assert chunks[0].token_ids == (1, 2, 3, 4, 5)
    assert isinstance(outs[-1], Done) and outs[-1].chunks == 2 and outs[-1].usage.completion_tokens == 6

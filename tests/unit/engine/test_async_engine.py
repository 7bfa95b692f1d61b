"""The asyncio API: prefill parks, decode resumes, export/import across engines, cancel frees."""

from __future__ import annotations

import pytest

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.errors import SequenceAborted, UnknownHandle
from pipeline.engine.params import EngineRequest
from tests.unit.engine.conftest import Loaded, chat_ids, make_engine


@pytest.mark.asyncio
async def test_prefill_decode_handoff_between_engines(loaded: Loaded) -> None:
    prompt = chat_ids(loaded, "Count to five.")
    source, target = AsyncEngine(make_engine(loaded)), AsyncEngine(make_engine(loaded))
    whole = [t async for t in source.generate(EngineRequest(prompt, 8))]
    first, handle = await source.prefill(EngineRequest(prompt, 8))
    assert source.is_parked(handle) and first == whole[0]
    moved = await target.import_kv(await source.export_kv(handle))
    assert source.cancel(handle) and not source.is_parked(handle)
    rest = [t async for t in target.decode(moved)]
    assert [first, *rest] == whole
    for engine in (source, target):
        bm = engine.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
        await engine.aclose()


@pytest.mark.asyncio
async def test_cancel_stops_a_running_stream_and_frees_its_blocks(loaded: Loaded) -> None:
    engine = AsyncEngine(make_engine(loaded))
    stream = engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 100), handle="h1")
    seen = []
    with pytest.raises(SequenceAborted):
        async for token in stream:
            seen.append(token)
            if len(seen) == 2:
                assert engine.cancel("h1")
    assert len(seen) == 2
    with pytest.raises(UnknownHandle):
        [t async for t in engine.decode("h1")]
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
    await engine.aclose()

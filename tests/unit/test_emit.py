import pytest

from pipeline.errors import Undeliverable
from pipeline.stages.emit import EmitStage
from tests.unit.fakes import run_handler
from tests.unit.helpers import SETTINGS
from topics import registry
from topics.errors import ErrorCode
from topics.stream import Chunk, Done, Failed, Usage
from topics.usage import UsageRecord

REPLY = "llm.responses.sdk"


def chunk(seq: int) -> Chunk:
    return Chunk(id="r1", reply_to=REPLY, seq=seq, text=f"t{seq}")


def done(chunks: int = 2) -> Done:
    return Done(id="r1", reply_to=REPLY, chunks=chunks, digest="d", finish_reason="stop", usage=Usage(3, 2), timings={"decode": 5.0}, created_at=1.0)


@pytest.mark.asyncio
async def test_forwards_chunks_then_one_terminal_and_a_usage_record() -> None:
    stage = EmitStage(SETTINGS)
    outs = [o for m in (chunk(0), chunk(1), done()) for o in await run_handler(stage, m)]
    assert [o.topic for o in outs] == [REPLY, REPLY, REPLY, registry.USAGE]
    terminal, usage = outs[2].value, outs[3].value
    assert isinstance(terminal, Done) and {"decode", "emit", "total"} <= set(terminal.timings)
    assert isinstance(usage, UsageRecord) and usage.outcome == "done" and usage.completion_tokens == 2


@pytest.mark.asyncio
async def test_drops_redelivered_chunks_and_terminals() -> None:
    stage = EmitStage(SETTINGS)
    sent = []
    for message in (chunk(0), chunk(1), chunk(0), chunk(1), done(), chunk(1), done()):
        sent += [o.value for o in await run_handler(stage, message) if o.topic == REPLY]
    assert [getattr(m, "seq", "end") for m in sent] == [0, 1, "end"]


@pytest.mark.asyncio
async def test_an_early_error_counts_the_chunks_emit_saw() -> None:
    stage = EmitStage(SETTINGS)
    await run_handler(stage, chunk(0))
    failed = Failed(id="r1", reply_to=REPLY, code=ErrorCode.internal, message="x", retriable=True)
    outs = await run_handler(stage, failed)
    assert outs[0].value.chunks == 1 and outs[1].value.outcome == "internal"


@pytest.mark.asyncio
async def test_refuses_to_write_to_an_unconfigured_topic() -> None:
    with pytest.raises(Undeliverable):
        await run_handler(EmitStage(SETTINGS), Chunk(id="r1", reply_to=registry.REQUESTS, seq=0, text="x"))

"""InstantBackend: numbered tokens, finish reasons, stop strings, resume from any point, cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from pipeline.backends.base import Delta, GenerationRequest, Message, Prefilled
from pipeline.backends.errors import Cancelled, InvalidRequest
from pipeline.backends.instant import FIRST_TOKEN_ID, InstantBackend

pytestmark = pytest.mark.asyncio


def request(max_tokens: int = 8, **kwargs: object) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt="count for me", max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def numbered(n: int, start: int = 0) -> str:
    return "".join(f"t{i} " for i in range(start, n))


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [delta async for delta in stream]


async def test_generate_numbers_every_token_and_ends_on_length() -> None:
    deltas = await collect(InstantBackend().generate(request(5)))
    assert [d.text for d in deltas] == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
    assert [d.token_ids for d in deltas] == [(FIRST_TOKEN_ID + i,) for i in range(5)]
    assert [d.finish_reason for d in deltas] == [None, None, None, None, "length"]


async def test_one_token_ends_at_prefill() -> None:
    backend = InstantBackend()
    prefilled = await backend.prefill(request(1))
    assert (prefilled.first_text, prefilled.finish_reason) == ("t0 ", "length")
    assert await collect(backend.decode(request(1), prefilled)) == []


async def test_prompt_tokens_count_characters() -> None:
    backend = InstantBackend()
    assert backend.count_prompt_tokens(request()) == len("count for me") // 4 + 1
    chat = GenerationRequest(request_id="c", messages=(Message("system", "abcd"), Message("user", "efgh")))
    assert backend.count_prompt_tokens(chat) == 3


async def test_stop_string_cuts_the_text() -> None:
    deltas = await collect(InstantBackend().generate(request(20, stop=("t3",))))
    assert "".join(d.text for d in deltas) == "t0 t1 t2 "
    assert deltas[-1].finish_reason == "stop"
    assert len(deltas) == 4


@pytest.mark.parametrize("consumed", [0, 1, 4, 9])
async def test_resume_from_any_point_sends_the_remaining_text(consumed: int) -> None:
    resumed = replace(request(10), resume_token_ids=tuple(FIRST_TOKEN_ID + i for i in range(consumed)))
    deltas = await collect(InstantBackend().generate(resumed))
    assert "".join(d.text for d in deltas) == numbered(10, consumed)
    assert deltas[-1].finish_reason == "length"


async def test_resume_with_unsent_characters_sends_them_first() -> None:
    consumed = tuple(FIRST_TOKEN_ID + i for i in range(3))
    resumed = replace(request(5), resume_token_ids=consumed, resume_sent_chars=len("t0 t1"))
    deltas = await collect(InstantBackend().generate(resumed))
    assert "".join(d.text for d in deltas) == " t2 t3 t4 "


async def test_resume_with_a_held_back_stop_prefix() -> None:
    """'t1 t' may start the stop 't1 t2': a resumed stream that continues past it sends the held text."""
    whole = await collect(InstantBackend().generate(request(6, stop=("t1 t9",))))
    text = "".join(d.text for d in whole)
    for cut in range(1, 6):
        first = await collect(InstantBackend().generate(request(cut, stop=("t1 t9",))))
        sent = "".join(d.text for d in first)
        resumed = replace(request(6, stop=("t1 t9",)), resume_token_ids=tuple(FIRST_TOKEN_ID + i for i in range(cut)),
                          resume_sent_chars=len(sent))
        rest = "".join(d.text for d in await collect(InstantBackend().generate(resumed)))
        assert sent + rest == text == numbered(6)


@pytest.mark.parametrize("consumed", [1, 2, 5, 9])
async def test_a_takeover_decodes_on_from_the_recorded_progress(consumed: int) -> None:
    """What a successor decode worker does: the last consumed token is handed over as the 'first' one,
    `resume_sent_chars` covers every consumed token, and `first_text` (prefill's, stale by now) is not read."""
    tokens = tuple(FIRST_TOKEN_ID + i for i in range(consumed))
    taken = replace(request(10), resume_token_ids=tokens[:-1], resume_sent_chars=len(numbered(consumed)))
    handoff = Prefilled("gone", tokens[-1], "t0 ", 3, None)
    rest = await collect(InstantBackend().decode(taken, handoff))
    assert "".join(d.text for d in rest) == numbered(10, consumed)
    assert [d.token_ids for d in rest] == [(FIRST_TOKEN_ID + i,) for i in range(consumed, 10)]


async def test_prefill_then_decode_matches_generate() -> None:
    backend = InstantBackend()
    prefilled = await backend.prefill(request(6))
    rest = await collect(backend.decode(request(6), prefilled))
    assert prefilled.first_text + "".join(d.text for d in rest) == numbered(6)


async def test_cancel_stops_a_running_stream_and_refuses_later_ones() -> None:
    backend = InstantBackend(token_delay_ms=5)
    stream = backend.generate(request(1000))
    assert (await anext(stream)).text == "t0 "
    await backend.cancel("r1")
    with pytest.raises(Cancelled):
        await collect(stream)
    with pytest.raises(Cancelled):
        await backend.prefill(request(3))
    other = await backend.prefill(replace(request(3), request_id="r2"))
    await backend.cancel("r2")
    with pytest.raises(Cancelled):
        await collect(backend.decode(replace(request(3), request_id="r2"), other))


async def test_token_delay_paces_the_stream() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await collect(InstantBackend(token_delay_ms=20).generate(request(5)))
    assert loop.time() - started >= 0.09


@pytest.mark.parametrize(
    "bad",
    [
        GenerationRequest(request_id="x", max_tokens=4),
        GenerationRequest(request_id="x", prompt="p", messages=(Message("user", "m"),)),
        GenerationRequest(request_id="x", prompt="p", max_tokens=0),
        GenerationRequest(request_id="x", prompt="p", max_tokens=2, resume_token_ids=(1000, 1001)),
    ],
)
async def test_invalid_requests_are_refused(bad: GenerationRequest) -> None:
    with pytest.raises(InvalidRequest):
        await InstantBackend().prefill(bad)


@pytest.mark.parametrize("stop", [(), ("t3",), ("t1 t9",), ("1 t", "t12 ")])
@pytest.mark.parametrize("consumed", [0, 2, 7])
async def test_token_text_extends_the_text_as_decoding_it_all_would(stop: tuple[str, ...], consumed: int) -> None:
    """The instant backend's text stream adds each token's text instead of decoding the whole completion
    again; the deltas must be the same, held-back stop prefixes and resumes included."""
    from pipeline.backends.instant import _detokenize, token_text
    from pipeline.backends.text_stream import TextStream

    done = [FIRST_TOKEN_ID + i for i in range(consumed)]
    streams = [
        TextStream(_detokenize, completion_ids=done, sent_chars=len(numbered(consumed)) - 1, stops=stop,
                   max_tokens=20, eos_ids=(), token_text=text)
        for text in (None, token_text)
    ]
    for i in range(consumed, 20):
        whole, added = (stream.push(FIRST_TOKEN_ID + i) for stream in streams)
        assert added == whole
        if whole.finish_reason is not None:
            break

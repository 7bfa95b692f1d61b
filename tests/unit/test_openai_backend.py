"""The `openai` backend kind against a real HTTP server speaking the protocol (bench.fake_openai), and
the generation stage that serves a pool of such backends."""

from __future__ import annotations

import asyncio

import pytest

from bench.fake_openai import FakeUpstream, State
from pipeline.backends.base import Backend, GenerationRequest, Message, SplitBackend
from pipeline.backends.errors import Cancelled, Filtered, InvalidRequest, ModelError, Overloaded
from pipeline.backends.openai_compat import OpenAIBackend, _event, _whole
from pipeline.stages.generate import GenerateStage
from pipeline.state import MemoryStateStore
from tests.ports import free_port
from tests.unit.fakes import run_handler
from tests.unit.helpers import admitted, request
from topics.errors import ErrorCode
from topics.hops import Route, Routed, forward
from topics.stream import Chunk, Done, Failed

pytestmark = pytest.mark.asyncio


def ask(n: int = 5, rid: str = "r1", prompt: str | None = None) -> GenerationRequest:
    messages = () if prompt else (Message("user", "hi"),)
    return GenerationRequest(request_id=rid, messages=messages, prompt=prompt, max_tokens=n)


async def collect(backend: OpenAIBackend, req: GenerationRequest) -> list:  # type: ignore[type-arg]
    return [d async for d in backend.generate(req)]


async def test_streams_chat_and_completions_with_the_upstreams_usage() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        assert isinstance(backend, Backend) and not isinstance(backend, SplitBackend)
        for req in (ask(5), ask(3, prompt="once upon")):
            deltas = await collect(backend, req)
            assert "".join(d.text for d in deltas) == "".join(f"w{i} " for i in range(req.max_tokens))
            assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == req.max_tokens
            assert deltas[-1].prompt_tokens == 8 and all(d.finish_reason is None for d in deltas[:-1])
        await backend.aclose()


async def test_a_non_streaming_request_is_asked_for_in_one_piece() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        for req in (ask(6), ask(4, prompt="once upon")):
            [whole] = await collect(backend, GenerationRequest(**{**req.__dict__, "stream": False}))
            assert whole.text == "".join(f"w{i} " for i in range(req.max_tokens)) and whole.finish_reason == "length"
            assert (whole.prompt_tokens, whole.completion_tokens) == (8, req.max_tokens)
        assert fake.state.served == 2
        await backend.aclose()


async def test_upstream_errors_map_to_sluice_codes() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        fake.state.mode = "busy"
        with pytest.raises(Overloaded) as busy:
            await collect(backend, ask())
        assert busy.value.retry_after_s == 1.0 and busy.value.code is ErrorCode.rate_limited
        fake.state.mode = "fail"
        with pytest.raises(ModelError):
            await collect(backend, ask())
        await backend.aclose()
    with pytest.raises(ModelError):  # nobody listening
        await collect(OpenAIBackend("gone", f"http://127.0.0.1:{free_port()}/v1", "m", timeout_s=2), ask())
    with pytest.raises(ValueError):
        OpenAIBackend("bad", "file:///etc/passwd", "m")
    assert InvalidRequest.code is ErrorCode.invalid_request


async def test_a_stalled_upstream_times_out_and_cancel_closes_the_stream() -> None:
    async with FakeUpstream(free_port()) as fake:
        fake.state.mode, fake.state.stall_s = "stall", 3.0
        with pytest.raises(ModelError):
            await collect(OpenAIBackend("up", fake.base_url, "m", timeout_s=0.5), ask())
        fake.state.mode, fake.state.token_delay_ms = "ok", 50.0
        backend = OpenAIBackend("up", fake.base_url, "m")
        seen: list[str] = []

        async def consume() -> None:
            async for delta in backend.generate(ask(100, rid="c1")):
                seen.append(delta.text)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        await backend.cancel("c1")
        with pytest.raises(Cancelled):
            await task
        assert len(seen) < 20
        for _ in range(100):
            if fake.state.left_early:
                break
            await asyncio.sleep(0.02)
        assert fake.state.left_early == 1  # the upstream saw the client leave
        await backend.aclose()


def routed(rid: str) -> Routed:
    return forward(admitted(request(rid)), Routed, route=Route(backend="up", pool="up"))  # type: ignore[return-value]


async def test_the_generation_stage_streams_and_a_successor_resumes_without_repeating() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        store = MemoryStateStore()
        stage = GenerateStage(backend, _topics(), store)
        outs = await run_handler(stage, routed("g1"))
        chunks = [o.value for o in outs if isinstance(o.value, Chunk)]
        done = outs[-1].value
        assert "".join(c.text for c in chunks) == "".join(f"w{i} " for i in range(8))
        assert isinstance(done, Done) and done.usage.completion_tokens == 8 and done.usage.prompt_tokens == 8

        # A worker dies after three chunks: its successor asks again and continues at chunk 3.
        first = GenerateStage(backend, _topics(), store := MemoryStateStore(), chunk_window_s=0)  # a chunk per token
        stream = first.handle(routed("g2"))
        for _ in range(3):
            out = await anext(stream)
            await out.acked()  # type: ignore[misc]
        await stream.aclose()
        rest = await run_handler(GenerateStage(backend, _topics(), store, chunk_window_s=0), routed("g2"))
        again = [o.value for o in rest if isinstance(o.value, Chunk)]
        assert again[0].seq == 3 and "".join(c.text for c in again) == "".join(f"w{i} " for i in range(3, 8))
        fake.state.mode = "fail"
        failed = (await run_handler(GenerateStage(backend, _topics(), MemoryStateStore()), routed("g3")))[-1].value
        assert isinstance(failed, Failed) and failed.code is ErrorCode.backend_error
        await backend.aclose()


def _topics():  # type: ignore[no-untyped-def]
    from pipeline.topology import graph

    return next(n for n in graph(("ingest", "route", "prefill", "decode", "emit"), ("up",), frozenset({"up"})) if n.kind == "generate").topics


async def test_the_upstreams_content_filter_ends_the_request_as_content_filter_never_as_stop() -> None:
    filtered = {"choices": [{"delta": {"content": ""}, "finish_reason": "content_filter"}]}
    with pytest.raises(Filtered) as caught:
        _event(filtered, None)
    assert caught.value.code is ErrorCode.content_filter and not caught.value.retriable
    with pytest.raises(Filtered):
        _whole({"choices": [{"message": {"content": "cut"}, "finish_reason": "content_filter"}], "usage": {}})
    for reason, ours in (("stop", "stop"), ("length", "length"), ("tool_calls", "stop"), ("eos_token", "stop")):
        assert _whole({"choices": [{"text": "x", "finish_reason": reason}]}).finish_reason == ours
        assert _event({"choices": [{"text": "x", "finish_reason": reason}]}, None)[1] == ours


async def test_an_upstream_event_of_another_shape_is_the_upstreams_failure() -> None:
    for event in (None, [1], {"choices": ["x"]}, {"choices": [{"delta": {"content": 5}}]}, {"choices": [{"delta": "x"}]},
                  {"choices": "x"}, {"usage": [1], "choices": []}):
        with pytest.raises(ModelError):
            _event(event, None)
    for answer in ({"choices": [{"message": {"content": 5}, "finish_reason": "stop"}]}, {"choices": "x"}, [1]):
        with pytest.raises(ModelError):
            _whole(answer)  # type: ignore[arg-type]
    odd = _whole({"choices": [{"text": "x", "finish_reason": "stop"}], "usage": {"prompt_tokens": "7", "completion_tokens": -1}})
    assert (odd.prompt_tokens, odd.completion_tokens) == (None, None)


async def test_an_upstreams_retry_after_is_a_finite_number_of_seconds() -> None:
    import httpx

    from pipeline.backends.openai_compat import MAX_RETRY_AFTER_S, _refused

    for header, seconds in (("2", 2.0), ("nan", None), ("inf", None), ("-3", None), ("1e9", MAX_RETRY_AFTER_S), ("soon", None)):
        refused = _refused(httpx.Response(429, headers={"retry-after": header}))
        assert isinstance(refused, Overloaded) and refused.retry_after_s == seconds, header


async def test_a_cancellation_before_the_upstream_answers_stops_the_request_when_it_does() -> None:
    async with FakeUpstream(free_port(), State(mode="stall", stall_s=0.3)) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        for stream in (True, False):
            req = GenerationRequest(**{**ask(30, rid=f"early-{stream}").__dict__, "stream": stream})
            running = asyncio.create_task(collect(backend, req))
            await asyncio.sleep(0.1)  # the upstream has not sent its headers yet
            await backend.cancel(req.request_id)
            with pytest.raises(Cancelled):
                await asyncio.wait_for(running, 5.0)
        await backend.aclose()



async def test_a_cancel_before_the_stream_began_stops_it_before_the_upstream_is_asked() -> None:
    """As the other backends do: a cancel that lands while the stage prepares the request (it was
    forgotten when the stream began, and the whole answer streamed and paid for)."""
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        await backend.cancel("early")
        with pytest.raises(Cancelled):
            await collect(backend, ask(rid="early"))
        assert fake.state.served == 0
        await backend.aclose()


async def test_cancels_are_remembered_within_a_bound() -> None:
    """A cancel that lands after its stream ended is kept only among the most recent (it stayed for
    good: one id per request cancelled as it ended)."""
    from pipeline.backends.openai_compat import _CANCELLED_MEMORY

    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        assert len(await collect(backend, ask(rid="ended"))) > 1
        await backend.cancel("ended")  # the stream ended already
        for i in range(_CANCELLED_MEMORY):
            await backend.cancel(f"gone-{i}")
        assert len(backend._cancelled) == _CANCELLED_MEMORY and "ended" not in backend._cancelled
        await backend.aclose()

"""The `openai` backend kind against a real HTTP server speaking the protocol (bench.fake_openai), and
the generation stage that serves a pool of such backends."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from bench.fake_openai import FakeUpstream, State
from pipeline.backends.base import Backend, Delta, GenerationRequest, Message, SplitBackend
from pipeline.backends.errors import Cancelled, Filtered, InvalidRequest, ModelError, Overloaded
from pipeline.backends.openai_compat import MAX_RETRY_AFTER_S, RETRY_WITHIN_S, OpenAIBackend, _event, _refused
from pipeline.routing.stats import BackendStats
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


async def test_a_non_streaming_request_is_streamed_from_the_upstream_too() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        for req in (ask(6), ask(4, prompt="once upon")):
            deltas = await collect(backend, GenerationRequest(**{**req.__dict__, "stream": False}))
            assert "".join(d.text for d in deltas) == "".join(f"w{i} " for i in range(req.max_tokens))
            assert deltas[-1].finish_reason == "length" and (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (8, req.max_tokens)
        assert fake.state.served == 2
        await backend.aclose()


async def test_connections_are_reused_streamed_or_whole() -> None:
    """The backend stopped reading at `[DONE]`, so every request opened a new connection (one socket
    in TIME_WAIT per request, about 0.35 ms of CPU on each side)."""
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m")
        for i in range(30):
            req = GenerationRequest(**{**ask(4, rid=f"r{i}").__dict__, "stream": i % 3 != 0})
            if i % 3 == 2:  # a consumer that stops at the ending, before the stream's `[DONE]` was read
                deltas = backend.generate(req)
                async for delta in deltas:
                    if delta.finish_reason is not None:
                        break
                await deltas.aclose()  # type: ignore[attr-defined]
            else:
                assert "".join(d.text for d in await collect(backend, req)) == "w0 w1 w2 w3 "
            await asyncio.sleep(0.01)  # what a body's end may still need to come in the background
        assert fake.state.served == 30 and len(fake.state.peers) <= 2
        await backend.aclose()


async def test_a_body_that_does_not_end_after_the_answer_holds_neither_the_request_nor_the_connection() -> None:
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:  # no length: the body ends at close
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + said("w", "stop") + b"data: [DONE]\n\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        started = time.monotonic()
        for rid in ("a", "b"):
            assert "".join(d.text for d in await collect(backend, ask(1, rid=rid))) == "w"
        assert time.monotonic() - started < 1.8 and len(upstream.bodies) == 2  # waiting for the drain: 2 s or more
        await backend.aclose()


def answers_then_drops(dropped_after_s: float, requests: list[int]) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A kept-alive upstream that answers a connection's first request and drops the connection on its
    second, `dropped_after_s` after reading it, unanswered; `requests` gets each request's number on its
    connection (0, 1)."""
    answer = said("ok", "stop") + b"data: [DONE]\n\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                requests.append(n)
                if n == 1:
                    await asyncio.sleep(dropped_after_s)
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(answer) + answer)
                await writer.drain()
        finally:
            writer.close()
    return serve


async def test_a_kept_alive_connection_the_upstream_closed_is_asked_again_on_a_new_one() -> None:
    """Its idle timeout raced the reuse: the upstream closed the connection as the second request came,
    before reading it. That request failed (ServerDisconnectedError), counted against a healthy upstream."""
    requests: list[int] = []
    server = await asyncio.start_server(answers_then_drops(0.0, requests), "127.0.0.1", 0)
    backend = OpenAIBackend("up", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", "m")
    for rid in ("a", "b", "c"):
        assert "".join(d.text for d in await collect(backend, ask(1, rid=rid))) == "ok"
    assert requests == [0, 1, 0, 1, 0]  # a; b on a's connection, dropped, then again on a new one; c likewise
    await backend.aclose()
    server.close()
    await server.wait_closed()


async def test_a_reused_connection_dropped_after_the_upstream_worked_on_the_request_is_not_asked_again() -> None:
    """Past RETRY_WITHIN_S the upstream may have been generating (a whole answer's headers come at its
    end): asking again would generate twice, so the failure is the upstream's."""
    requests: list[int] = []
    server = await asyncio.start_server(answers_then_drops(RETRY_WITHIN_S + 0.3, requests), "127.0.0.1", 0)
    backend = OpenAIBackend("up", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", "m")
    assert "".join(d.text for d in await collect(backend, ask(1, rid="a"))) == "ok"
    with pytest.raises(ModelError, match="connection failed"):
        await collect(backend, ask(1, rid="b"))
    assert requests == [0, 1]  # b was sent once
    await backend.aclose()
    server.close()
    await server.wait_closed()


async def test_a_base_url_with_credentials_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="api_key_env"):
        OpenAIBackend("up", "https://user:secret@api.example.com/v1", "m")


@pytest.mark.filterwarnings("ignore:Sending a large body:ResourceWarning")  # aiohttp's, for a body over 1 MiB
async def test_an_upstream_that_never_reads_the_request_times_out() -> None:
    """Nothing bounded writing the request: a listening upstream that reads nothing held a prompt larger
    than the sockets' buffers."""
    holding: list[asyncio.Task[Any]] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        holding.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await asyncio.sleep(10)
        finally:
            writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    backend = OpenAIBackend("up", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", "m", timeout_s=0.5)
    big = GenerationRequest(request_id="big", messages=(Message("user", "x" * (8 << 20)),), max_tokens=1)
    started = time.monotonic()
    with pytest.raises(ModelError, match="timed out"):
        await collect(backend, big)
    assert time.monotonic() - started < 3.0
    await backend.aclose()
    for task in holding:
        task.cancel()
    await asyncio.gather(*holding, return_exceptions=True)
    server.close()
    await server.wait_closed()


async def test_with_stream_upstream_off_a_whole_answer_is_asked_whole_and_a_stream_still_streamed() -> None:
    async with FakeUpstream(free_port()) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m", stream_upstream=False)
        for req in (ask(6), ask(4, prompt="once upon")):
            for stream in (False, True):
                deltas = await collect(backend, GenerationRequest(**{**req.__dict__, "stream": stream}))
                assert "".join(d.text for d in deltas) == "".join(f"w{i} " for i in range(req.max_tokens))
                assert deltas[-1].finish_reason == "length" and (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (8, req.max_tokens)
                assert len(deltas) == (req.max_tokens + 1 if stream else 1)  # streamed: a delta per word, then the ending
        assert fake.state.served == 4 and len(fake.state.peers) == 1
        await backend.aclose()


class Raw:
    """A bare HTTP/1.1 upstream whose answer the test writes byte for byte: `answer(body, writer)`."""

    def __init__(self, answer: Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]) -> None:
        self._answer = answer
        self.bodies: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Raw:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            self.bodies.append(json.loads(await reader.readexactly(length)))
            await self._answer(self.bodies[-1], writer)
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test ended
        finally:
            writer.close()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def sse(event: object) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def said(text: str, reason: str | None = None) -> bytes:
    return sse({"choices": [{"delta": {"content": text}, "finish_reason": reason}]})


async def test_a_whole_answer_is_streamed_so_the_timeout_is_between_events_not_over_the_answer() -> None:
    """vLLM sends a non-streamed answer only once all of it is generated: asked so, every answer longer
    than `timeout_s` failed (and counted against a healthy backend)."""
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if not body.get("stream"):  # the whole answer, after generating it
            await asyncio.sleep(1.6)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            return
        writer.write(SSE_HEAD)
        for _ in range(4):
            await asyncio.sleep(0.3)
            writer.write(said("w"))
        writer.write(said("", "stop") + sse({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}) + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", timeout_s=0.5)
        deltas = await collect(backend, GenerationRequest(**{**ask(4).__dict__, "stream": False}))
        assert "".join(d.text for d in deltas) == "wwww" and deltas[-1].finish_reason == "stop"
        assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (2, 4)
        assert upstream.bodies[0]["stream"] is True and upstream.bodies[0]["stream_options"] == {"include_usage": True}
        await backend.aclose()


async def test_lines_end_at_lf_only_so_unicode_line_separators_stay_in_the_text() -> None:
    text = "a\u2028b\u2029c\u0085d\u00e9"

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        event = said(text).replace(b"\n\n", b"\r\n\r\n")  # CRLF lines too
        writer.write(SSE_HEAD + event[:-6])  # the last character's two bytes split across reads
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(event[-6:] + said("", "stop") + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        deltas = await collect(backend, ask())
        assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason == "stop"
        await backend.aclose()


async def test_an_upstream_that_sends_only_keep_alives_has_stalled() -> None:
    """Comments and empty events restart the read timeout: the stream waited for the upstream to close."""
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + said("a"))
        for i in range(40):
            writer.write(b": ping\n\n" if i % 2 else sse({"choices": []}))
            await writer.drain()
            await asyncio.sleep(0.1)

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(ModelError, match="no text"):
            await collect(backend, ask())
        assert time.monotonic() - started < 2.0
        await backend.aclose()


@pytest.mark.parametrize("body", [
    b"data: " + b"[" * 200_000 + b"]" * 200_000 + b"\n\n",  # deeper than the parser goes (RecursionError)
    b'data: {"choices": [{"delta": {"content": "\xff"}}]}\n\n',  # not UTF-8
])
async def test_an_event_the_parser_cannot_take_is_the_upstreams_failure(body: bytes) -> None:
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + body + said("", "stop") + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        with pytest.raises(ModelError):
            await collect(backend, ask())
        await backend.aclose()


@pytest.mark.parametrize("case", ["line", "body"])
async def test_an_answer_past_its_size_bounds_is_the_upstreams_failure(case: str) -> None:
    """A 600 MB `data:` line took a worker to 2.3 GB; a body is bounded by `max_tokens` too."""
    line = said("x" * (1 << 20))  # valid JSON, one line past the bound (MAX_LINE_BYTES, 1 MiB)

    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        if case == "line":
            writer.write(line)
        else:  # small events, far more of them than one token each
            for _ in range(400):
                writer.write(said("y" * 8192))
                await writer.drain()
        writer.write(said("", "stop") + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        with pytest.raises(ModelError):
            await collect(backend, ask(2000 if case == "line" else 1))
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
    gone = OpenAIBackend("gone", f"http://127.0.0.1:{free_port()}/v1", "m", timeout_s=2)
    with pytest.raises(ModelError, match="unreachable"):  # nobody listening
        await collect(gone, ask())
    await gone.aclose()
    with pytest.raises(ValueError):
        OpenAIBackend("bad", "file:///etc/passwd", "m")
    assert InvalidRequest.code is ErrorCode.invalid_request


async def test_a_stalled_upstream_times_out_and_cancel_closes_the_stream() -> None:
    async with FakeUpstream(free_port()) as fake:
        fake.state.mode, fake.state.stall_s = "stall", 3.0
        stalled = OpenAIBackend("up", fake.base_url, "m", timeout_s=0.5)
        with pytest.raises(ModelError):
            await collect(stalled, ask())
        await stalled.aclose()
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
    for reason, ours in (("stop", "stop"), ("length", "length"), ("tool_calls", "stop"), ("function_call", "stop"),
                         ("eos_token", "stop"), ("stop_sequence", "stop"), ("end_turn", "stop")):
        assert _event({"choices": [{"text": "x", "finish_reason": reason}]}, None)[1] == ours


@pytest.mark.parametrize("reason", ["abort", "error", "repetition", "something_new", 5, ["stop"]])
async def test_an_ending_that_is_not_an_answer_is_the_upstreams_failure(reason: object) -> None:
    """vLLM v1 ends a dropped or failed request `abort`/`error`: it passed as a whole answer (`stop`)."""
    with pytest.raises(ModelError) as caught:
        _event({"choices": [{"text": "cut", "finish_reason": reason}]}, None)
    assert caught.value.retriable


async def test_an_upstream_event_of_another_shape_is_the_upstreams_failure() -> None:
    for event in (None, [1], {"choices": ["x"]}, {"choices": [{"delta": {"content": 5}}]}, {"choices": [{"delta": "x"}]},
                  {"choices": "x"}, {"usage": [1], "choices": []}):
        with pytest.raises(ModelError):
            _event(event, None)
    odd, _ = _event({"choices": [{"text": "x", "finish_reason": "stop"}], "usage": {"prompt_tokens": "7", "completion_tokens": -1}}, None)
    assert odd is not None and (odd.prompt_tokens, odd.completion_tokens) == (None, None)


async def test_an_upstreams_retry_after_is_a_finite_number_of_seconds() -> None:
    for header, seconds in (("2", 2.0), ("nan", None), ("inf", None), ("-3", None), ("1e9", MAX_RETRY_AFTER_S), ("soon", None),
                            ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER_S),
                            ("Wed, 32 Oct 2015 07:28:00 GMT", None)):
        refused = _refused(429, header)
        assert isinstance(refused, Overloaded) and refused.retry_after_s == seconds, header


async def test_an_http_date_retry_after_is_passed_on_in_seconds() -> None:
    header = email.utils.formatdate(time.time() + 30, usegmt=True)
    refused = _refused(429, header)
    assert isinstance(refused, Overloaded) and refused.retry_after_s is not None and 28 <= refused.retry_after_s <= 30


async def test_an_upstream_misconfigured_is_its_failure_and_only_a_bad_request_is_the_clients() -> None:
    """401/403 (the key), 404/405 (the address) and redirects were the client's 400: never retried
    elsewhere, never counted, the backend never ejected."""
    for status in (301, 302, 307, 401, 402, 403, 404, 405, 407, 408, 409, 410, 500, 502, 503):
        refused = _refused(status)
        assert isinstance(refused, ModelError) and refused.retriable, status
    for status in (400, 413, 422):
        refused = _refused(status)
        assert isinstance(refused, InvalidRequest) and not refused.retriable, status


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


async def test_an_upstream_that_sends_no_usage_is_billed_an_estimate() -> None:
    """A text backend's usage was 0/0 (no token ids to count): an answer billed nothing."""
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + said("hello world!") + said("", "stop") + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        done = (await run_handler(GenerateStage(backend, _topics(), MemoryStateStore()), routed("u1")))[-1].value
        assert isinstance(done, Done)  # "hello world!" (12 characters), 4 to a token; the prompt as the gateway
        # estimates it at admission: "hello there" (11 ASCII bytes, 3 tokens) and one message's markers (4)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, 3)
        await backend.aclose()


async def test_a_stalled_upstream_ends_at_the_requests_deadline_not_when_it_closes() -> None:
    """Keep-alives reset the backend's timeout and brought no delta, so the stage's deadline check never
    ran: the request outlived its deadline (and ended `client_gone`, never counted)."""
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + said("a"))
        for _ in range(40):
            writer.write(b": ping\n\n")
            await writer.drain()
            await asyncio.sleep(0.1)

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", timeout_s=30)
        stats = BackendStats("up", "up", "w1", capacity=4, eject_after=1)
        message = forward(admitted(request("d1", deadline_s=1.0)), Routed, route=Route(backend="up", pool="up"))
        started = time.monotonic()
        outs = await run_handler(GenerateStage(backend, _topics(), MemoryStateStore(), stats=stats), message)
        failed = outs[-1].value
        assert isinstance(failed, Failed) and failed.code is ErrorCode.deadline_exceeded
        assert time.monotonic() - started < 2.5
        assert stats.streak == 0 and stats.in_flight == 0  # a deadline says nothing of the backend's health
        await backend.aclose()


async def test_events_after_the_ending_are_not_a_second_ending() -> None:
    """An upstream that puts the usage on its finish event and sends it again gave the stage two endings."""
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        writer.write(SSE_HEAD + sse({"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}], "usage": usage})
                     + sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        [delta] = await collect(backend, ask())
        assert (delta.text, delta.finish_reason, delta.completion_tokens) == ("hi", "stop", 1)
        await backend.aclose()


async def test_a_non_streamed_answer_that_breaks_midway_yields_nothing_so_route_reroutes_it() -> None:
    """Asked for a whole answer, the backend used to read one body: a broken upstream failed before any
    chunk, and the route's next backend took the request. Streamed from the upstream, its first words went
    out before the break, and the client got an error instead. The deltas are held to the end now."""
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + said("half an ") + said("answer"))
        await writer.drain()
        writer.close()  # the connection drops: no finish

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m")
        got: list[Delta] = []
        with pytest.raises(ModelError):
            async for delta in backend.generate(GenerationRequest(**{**ask(8).__dict__, "stream": False})):
                got.append(delta)
        assert got == []
        await backend.aclose()


async def test_a_model_that_reasons_before_it_answers_is_not_a_stall() -> None:
    """`reasoning_content` deltas carry no `content`: counted as no progress, a model thinking longer than
    `timeout_s` failed as stalled, and a healthy reasoning upstream was ejected."""
    async def answer(_: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for _ in range(8):
            writer.write(sse({"choices": [{"delta": {"reasoning_content": "hmm "}, "finish_reason": None}]}))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(said("42", "stop") + b"data: [DONE]\n\n")

    async with Raw(answer) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", timeout_s=0.3)
        deltas = await collect(backend, ask(4))
        assert "".join(d.text for d in deltas) == "42" and deltas[-1].finish_reason == "stop"
        await backend.aclose()


@pytest.mark.parametrize(("answer", "error"), [
    (b"[1, 2]", "another shape"), (b'{"choices": []}', "another shape"),
    (b'{"choices": [{"message": "hi", "finish_reason": "stop"}]}', "another shape"),
    (b'{"choices": [{"message": {"content": 7}, "finish_reason": "stop"}]}', "not a string"),
    (b'{"choices": [{"text": "hi"}]}', "no finish reason"), (b'{"choices": [{"text": "hi", "finish_reason": "abort"}]}', "abort"),
    (b"not json", "not JSON"), (b'{"choices": [{"text": "\xff", "finish_reason": "stop"}]}', "not JSON"),
])
async def test_a_whole_answer_of_another_shape_is_the_upstreams_failure(answer: bytes, error: str) -> None:
    async def reply(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + answer)

    async with Raw(reply) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", stream_upstream=False)
        with pytest.raises(ModelError, match=error):
            await collect(backend, GenerationRequest(**{**ask(2).__dict__, "stream": False}))
        assert upstream.bodies[-1]["stream"] is False and "stream_options" not in upstream.bodies[-1]
        await backend.aclose()


async def test_a_cancel_stops_a_whole_answer_before_its_headers_come() -> None:
    """A whole answer's headers come once it is generated: the cancel waited for all of it."""
    async with FakeUpstream(free_port(), State(mode="stall", stall_s=3.0)) as fake:
        backend = OpenAIBackend("up", fake.base_url, "m", stream_upstream=False)
        running = asyncio.create_task(collect(backend, GenerationRequest(**{**ask(4, rid="w").__dict__, "stream": False})))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await backend.cancel("w")
        with pytest.raises(Cancelled):
            await asyncio.wait_for(running, 5.0)
        assert time.monotonic() - started < 1.5
        await backend.aclose()


async def test_a_key_read_from_a_secret_file_loses_its_newline_and_a_key_a_header_cannot_carry_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UP_KEY", "sk-abc\n")
    assert OpenAIBackend.from_env("up", "http://127.0.0.1:1/v1", "m", "UP_KEY", 5.0)._headers["authorization"] == "Bearer sk-abc"
    with pytest.raises(ValueError, match="header"):
        OpenAIBackend("up", "http://127.0.0.1:1/v1", "m", api_key="sk-a\r\nx-injected: 1")


async def test_a_whole_answer_past_its_size_bound_is_the_upstreams_failure() -> None:
    async def reply(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
        for _ in range(64):
            writer.write(b" " * (1 << 16))
            await writer.drain()

    async with Raw(reply) as upstream:
        backend = OpenAIBackend("up", upstream.base_url, "m", stream_upstream=False)
        with pytest.raises(ModelError, match="larger than"):  # 1 token: 2 KiB + 1 MiB of slack; 4 MiB sent
            await collect(backend, GenerationRequest(**{**ask(1).__dict__, "stream": False}))
        await backend.aclose()

"""The bridge against the real pipeline: the official `openai` client, server-sent events, the WebSocket,
errors with their statuses, and a client that leaves mid-stream cancelling its request."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
import websockets
from aiokafka import AIOKafkaConsumer
from prometheus_client.parser import text_string_to_metric_families

from pipeline import kafka
from pipeline.bridge.app import body_cap
from tests.integration.conftest import Bridge
from topics import codec, registry
from topics.errors import ErrorCode
from topics.hops import client_id_of
from topics.requests import Request
from topics.stream import Chunk, Failed, StreamEvent

pytestmark = pytest.mark.asyncio(loop_scope="session")
HELLO = [{"role": "user", "content": "Say hello in five words."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


async def test_openai_client_streams_chat(bridge: Bridge) -> None:
    model = bridge.settings.models[0]
    async with bridge.openai() as client:
        stream = await client.chat.completions.create(
            model=model, messages=HELLO, max_tokens=12, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.model == model and c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in with_choices).strip()
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert 0 < usage.completion_tokens <= 12 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_openai_client_gets_a_whole_chat_completion_with_usage(bridge: Bridge) -> None:
    async with bridge.openai() as client:
        answer = await client.chat.completions.create(model=bridge.settings.models[0], messages=HELLO, max_tokens=8)  # type: ignore[arg-type]
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8 and answer.usage.prompt_tokens > 0


async def test_openai_client_completions_whole_and_streamed(bridge: Bridge) -> None:
    model = bridge.settings.models[0]
    async with bridge.openai() as client:
        whole = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=6)
        streamed = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, stream=True)
        pieces = [chunk async for chunk in streamed]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.choices[0].text
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 6
    assert "".join(p.choices[0].text for p in pieces).strip()
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


async def test_models_lists_the_configured_models(bridge: Bridge) -> None:
    async with bridge.openai() as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == list(bridge.settings.models)


async def test_an_unknown_model_is_a_404_with_an_openai_error(bridge: Bridge) -> None:
    async with bridge.openai() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-17", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
    assert caught.value.status_code == 404
    async with httpx.AsyncClient(base_url=bridge.url) as http:
        response = await http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": HELLO, "stream": True})
    assert response.status_code == 404 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error" and error["param"] is None
    assert bridge.settings.models[0] in error["message"]


async def test_max_tokens_over_the_cap_is_a_400(bridge: Bridge) -> None:
    async with bridge.openai() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=bridge.settings.models[0], messages=HELLO, max_tokens=bridge.settings.limits.max_tokens_cap + 1,  # type: ignore[arg-type]
            )
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_request"


async def test_malformed_and_oversized_bodies_are_refused_by_the_bridge(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.url) as http:
        bad = await http.post("/v1/chat/completions", json={"model": bridge.settings.models[0], "messages": HELLO, "n": 3})
        big = await http.post("/v1/completions", content=b"x" * (body_cap(bridge.settings.limits) + 1))
        metrics = await http.get("/metrics")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert big.status_code == 413 and big.json()["error"]["code"] == "invalid_request"
    assert metrics.status_code == 200
    [messages] = [f for f in text_string_to_metric_families(metrics.text) if f.name == "sluice_messages"]
    assert any(s.labels == {"stage": "bridge", "outcome": "done"} and s.value > 0 for s in messages.samples)


async def test_websocket_runs_requests_concurrently(bridge: Bridge) -> None:
    model = bridge.settings.models[0]
    async with websockets.connect(bridge.ws_url) as ws:
        await ws.send(json.dumps({"model": model, "messages": HELLO, "max_tokens": 8}))
        await ws.send(json.dumps({"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}))
        await ws.send("not json")
        messages = await _ws_until(ws, lambda seen: sum(1 for m in seen if m["type"] in ("done", "error") and m["id"]) == 2)
    starts = [m for m in messages if m["type"] == "start"]
    refusal = next(m for m in messages if m["type"] == "error")
    assert len(starts) == 2 and refusal["id"] is None and refusal["code"] == "invalid_request"
    for start in starts:
        chunks = [m for m in messages if m["type"] == "chunk" and m["id"] == start["id"]]
        [done] = [m for m in messages if m["type"] == "done" and m["id"] == start["id"]]
        assert [c["seq"] for c in chunks] == list(range(done["chunks"])) and chunks
        assert done["finish_reason"] in ("stop", "length") and 0 < done["usage"]["completion_tokens"] <= 8


async def test_websocket_reports_a_refused_request(bridge: Bridge) -> None:
    async with websockets.connect(bridge.ws_url) as ws:
        await ws.send(json.dumps({"model": "gpt-17", "messages": HELLO}))
        messages = await _ws_until(ws, lambda seen: any(m["type"] == "error" for m in seen))
    start, error = messages
    assert start["type"] == "start" and error["id"] == start["id"]
    assert error["code"] == "not_found" and error["retriable"] is False


async def test_leaving_an_sse_stream_cancels_the_request(bridge: Bridge) -> None:
    watch = await kafka.broadcast_consumer(bridge.settings, (registry.reply_topic(bridge.settings.bridge.reply_name),), "test-bridge-watch")
    try:
        body = {"model": bridge.settings.models[0], "messages": STORY, "max_tokens": 300, "stream": True}
        async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                events = [json.loads(line[6:]) async for line in _first_data_lines(response, 2)]
        rid = events[0]["id"].removeprefix("chatcmpl-")
        terminal = await _terminal_of(watch, rid)
    finally:
        await watch.stop()
    assert isinstance(terminal, Failed) and terminal.code is ErrorCode.cancelled
    assert terminal.usage.completion_tokens < 100


async def test_leaving_before_a_whole_answer_cancels_the_request(bridge: Bridge) -> None:
    """Not streaming: the client gives up (its connection closes) before the answer is there. It never
    sees its request's id: the test finds it on llm.requests by the user agent it sent."""
    watch = await kafka.broadcast_consumer(bridge.settings, (registry.reply_topic(bridge.settings.bridge.reply_name),), "test-bridge-whole-watch")
    sent = await kafka.broadcast_consumer(bridge.settings, (registry.REQUESTS,), "test-bridge-whole-sent")
    agent = f"test-bridge-whole-{uuid.uuid4().hex}"
    try:
        body = {"model": bridge.settings.models[0], "messages": STORY, "max_tokens": 300}
        async with httpx.AsyncClient(base_url=bridge.url, timeout=120, headers={"user-agent": agent}) as http:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(3):
                    await http.post("/v1/chat/completions", json=body)
        terminal = await _terminal_of(watch, await _id_sent_by(sent, agent))
    finally:
        await watch.stop()
        await sent.stop()
    assert isinstance(terminal, Failed) and terminal.code is ErrorCode.cancelled
    assert terminal.usage.completion_tokens < 200


async def test_closing_a_websocket_cancels_its_requests(bridge: Bridge) -> None:
    watch = await kafka.broadcast_consumer(bridge.settings, (registry.reply_topic(bridge.settings.bridge.reply_name),), "test-bridge-ws-watch")
    try:
        async with websockets.connect(bridge.ws_url) as ws:
            await ws.send(json.dumps({"model": bridge.settings.models[0], "messages": STORY, "max_tokens": 300}))
            messages = await _ws_until(ws, lambda seen: sum(1 for m in seen if m["type"] == "chunk") == 2)
        terminal = await _terminal_of(watch, messages[0]["id"])
    finally:
        await watch.stop()
    assert isinstance(terminal, Failed) and terminal.code is ErrorCode.cancelled
    assert terminal.usage.completion_tokens < 100


async def _first_data_lines(response: httpx.Response, n: int) -> AsyncIterator[str]:
    seen = 0
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            yield line
            seen += 1
            if seen == n:
                return


async def _terminal_of(consumer: AIOKafkaConsumer, request_id: str, timeout: float = 60.0) -> StreamEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=200)
        for records in batch.values():
            for record in records:
                if client_id_of((record.key or b"").decode()) == request_id:
                    event = codec.decode(record.value or b"", StreamEvent)
                    if not isinstance(event, Chunk):
                        return event
    raise AssertionError(f"no terminal event for {request_id} within {timeout} s")


async def _id_sent_by(consumer: AIOKafkaConsumer, user_agent: str, timeout: float = 60.0) -> str:
    """The client id of the request the bridge sent on llm.requests for a caller with this user agent
    (for a test whose client never saw its request's id)."""
    async with asyncio.timeout(timeout):
        while True:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    try:
                        request = codec.decode(record.value or b"", Request)
                    except codec.SchemaError:  # another test's hostile record
                        continue
                    if request.user_agent == user_agent:
                        return client_id_of(request.id)


async def _ws_until(ws: Any, enough: Callable[[list[dict[str, Any]]], bool], timeout: float = 120.0) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while not enough(seen):
            seen.append(json.loads(await ws.recv()))
    return seen

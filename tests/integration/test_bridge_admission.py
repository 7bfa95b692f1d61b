"""bridge.max_in_flight: a request over the bound is a 503 with Retry-After at once, over HTTP and over
the WebSocket, and the place is given back when a request ends (however it ends)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import pytest_asyncio
import websockets

from pipeline.settings import Settings
from tests.integration.conftest import Bridge, serving_bridge

pytestmark = pytest.mark.asyncio(loop_scope="session")

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def narrow(stack: Settings) -> AsyncIterator[Bridge]:
    async with serving_bridge(replace(stack, bridge=replace(stack.bridge, max_in_flight=1))) as served:
        yield served


async def _first_event(response: httpx.Response) -> None:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            return


async def test_a_request_over_the_bound_is_a_503_until_a_place_is_free(narrow: Bridge) -> None:
    model = narrow.settings.models[0]
    body = {"model": model, "messages": STORY, "max_tokens": 300, "stream": True}
    small = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=narrow.url, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as long:
            await _first_event(long)  # the one place is taken
            refused = await http.post("/v1/chat/completions", json=small)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "unavailable"
            async with websockets.connect(narrow.ws_url) as ws:
                await ws.send(json.dumps(small))
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert message["type"] == "error" and message["code"] == "unavailable" and message["id"] is None
        # leaving the stream cancelled the long request and gave its place back
        for _ in range(50):
            answer = await http.post("/v1/chat/completions", json=small)
            if answer.status_code != 503:
                break
            await asyncio.sleep(0.1)
        assert answer.status_code == 200, answer.text
    async with websockets.connect(narrow.ws_url) as ws:  # a WebSocket request takes and gives back a place too
        for _ in range(2):
            await ws.send(json.dumps(small))
            events = [json.loads(await asyncio.wait_for(ws.recv(), 120))]
            while events[-1]["type"] not in ("done", "error"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            assert events[0]["type"] == "start" and events[-1]["type"] == "done", events

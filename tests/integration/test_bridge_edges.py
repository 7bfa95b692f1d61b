"""The bridge's edges against the real stack, behind an ingest with `auth_required` and an IP allow list:
undecodable and too-deep bodies, authentication before validation, /metrics behind a token, request-head
and body timeouts, and the WebSocket's client address and credential."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets

from pipeline.gateway.config import NetworkSettings
from pipeline.settings import Settings
from tests.integration.gateway_fixtures import CLIENT_SECRET, SecureBridge, front_door, with_gateway

pytestmark = pytest.mark.asyncio(loop_scope="session")
METRICS_TOKEN = "edge-metrics-token-0123456789"
DEEP = b'{"model":"m","messages":' + b"[" * 10_000 + b"]" * 10_000 + b"}"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def edge(stack: Settings) -> AsyncIterator[SecureBridge]:
    settings = with_gateway(stack, auth_required=True, key_cache_s=0.0, client_info_secret=CLIENT_SECRET,
                            network=NetworkSettings(allow_cidrs=("127.0.0.1/32",)))
    settings = replace(settings, bridge=replace(settings.bridge, header_timeout_s=1.0, body_timeout_s=1.0,
                                                metrics_token=METRICS_TOKEN))
    async with front_door(settings, "llm.requests.edge-test", "ingest-edge") as door:
        yield door


async def test_an_undecodable_or_too_deep_body_is_a_400_in_openai_format(edge: SecureBridge) -> None:
    key, _ = await edge.keys.create("acme")
    async with httpx.AsyncClient(base_url=edge.url, headers={"authorization": f"Bearer {key}"}) as http:
        for body in (DEEP, b"\xff\xfe{", b'{"model": "m", "messages": [}', b"[1]"):
            response = await http.post("/v1/chat/completions", content=body)
            assert response.status_code == 400, body[:20]
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
        assert "nested too deeply" in (await http.post("/v1/chat/completions", content=DEEP)).json()["error"]["message"]


async def test_a_too_deep_websocket_message_is_an_error_message_and_the_socket_lives_on(edge: SecureBridge) -> None:
    key, _ = await edge.keys.create("acme")
    ws_url = edge.url.replace("http://", "ws://") + "/v1/stream"
    async with websockets.connect(ws_url, additional_headers={"authorization": f"Bearer {key}"}, max_size=None) as ws:
        await ws.send(DEEP.decode())
        refused = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert refused["type"] == "error" and refused["code"] == "invalid_request" and "deeply" in refused["message"]
        await ws.send("not json")
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "error"


async def test_with_auth_required_the_credential_is_checked_before_the_request(edge: SecureBridge) -> None:
    model = edge.settings.models[0]
    cap = edge.settings.limits.max_tokens_cap
    probing = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": cap * 10}
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as http:
        for headers in ({}, {"authorization": "Bearer sk-sluice-" + "A" * 43}, {"authorization": "Bearer unused"}):
            response = await http.post("/v1/chat/completions", json=probing, headers=headers)
            assert response.status_code == 401, headers
            assert model not in response.text and str(cap) not in response.text
            assert (await http.post("/v1/chat/completions", content=DEEP, headers=headers)).status_code in (400, 401)
        assert (await http.post("/v1/chat/completions", content=b"{", headers={})).status_code == 401
        for headers in ({}, {"authorization": "Bearer unused"}, {"authorization": "Bearer sk-sluice-" + "A" * 43}):
            models = await http.get("/v1/models", headers=headers)  # any bearer string was enough for the list
            assert models.status_code == 401 and model not in models.text, headers
        key, _ = await edge.keys.create("acme")
        assert (await http.get("/v1/models", headers={"authorization": f"Bearer {key}"})).status_code == 200
        known = await http.post("/v1/chat/completions", json=probing, headers={"authorization": f"Bearer {key}"})
        assert known.status_code == 400 and str(cap) in known.text  # a tenant with a key is told why


async def test_metrics_need_their_token_on_the_api_port(edge: SecureBridge) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={"authorization": "Bearer wrong"})).status_code == 401
        key, _ = await edge.keys.create("acme")
        assert (await http.get("/metrics", headers={"authorization": f"Bearer {key}"})).status_code == 401
        shown = await http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
        assert shown.status_code == 200 and "sluice_" in shown.text


def _port(edge: SecureBridge) -> int:
    return edge.settings.bridge.port


async def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(edge: SecureBridge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(edge))
    started = time.monotonic()
    closed_after = None
    try:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue
    except ConnectionError:
        closed_after = time.monotonic() - started
    finally:
        writer.close()
    assert closed_after is not None and closed_after < 4.0  # header_timeout_s = 1


async def test_a_keep_alive_connection_is_timed_out_on_its_next_slow_head_too(edge: SecureBridge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(edge))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert b"200 OK" in await asyncio.wait_for(reader.read(4096), 5)
    writer.write(b"G")  # the next head starts and stalls
    assert await asyncio.wait_for(reader.read(1), 4) == b""
    writer.close()


async def test_a_body_that_does_not_arrive_is_a_408(edge: SecureBridge) -> None:
    key, _ = await edge.keys.create("acme")
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(edge))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: 500\r\n\r\n".encode() + b'{"model": ')
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer


async def test_the_websocket_passes_the_client_address_like_http(edge: SecureBridge) -> None:
    """Ingest allows only 127.0.0.1: a request that came without its address would be refused (403)."""
    key, _ = await edge.keys.create("acme")
    ws_url = edge.url.replace("http://", "ws://") + "/v1/stream"
    body = {"model": edge.settings.models[0], "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    async with websockets.connect(ws_url, additional_headers={"authorization": f"Bearer {key}"}) as ws:
        await ws.send(json.dumps(body))
        events = [json.loads(await asyncio.wait_for(ws.recv(), 120))]
        while events[-1]["type"] not in ("done", "error"):
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
    assert events[0]["type"] == "start" and events[-1]["type"] == "done", events[-1]
    async with httpx.AsyncClient(base_url=edge.url, timeout=120) as http:
        response = await http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200


async def test_a_websocket_without_a_valid_credential_is_refused_at_its_handshake(edge: SecureBridge) -> None:
    """No credential, or a made-up key of the right shape (looked up in Redis: it used to be accepted and
    each of its messages sent into Kafka), gets a 401 in place of the 101."""
    ws_url = edge.url.replace("http://", "ws://") + "/v1/stream"
    for headers in ({}, {"authorization": "Bearer sk-sluice-" + "A" * 16}):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 401
        error: Any = json.loads(refused.value.response.body)["error"]
        assert error["code"] == "unauthorized"

"""`/v1/stream` (pipeline/bridge/websocket.py) driven over ASGI in the test's own loop, so the test decides
when the pipeline answers: how many requests one socket may run at once (`bridge.ws_max_requests`),
when an idle socket is closed (`bridge.ws_idle_s`), and how a handshake is refused where the server has
no denial response (this scope has no extensions)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from pipeline.bridge.app import create_app
from pipeline.bridge.credentials import Credential, Credentials, KeysAway
from pipeline.settings import Settings
from tests.unit.test_bridge_app import SETTINGS, HoldingClient, chat, with_gateway

IDLE_S = 0.2


def bridge_settings(**changes: Any) -> Settings:
    return dataclasses.replace(SETTINGS, bridge=dataclasses.replace(SETTINGS.bridge, **changes))


class Socket:
    """The client's end of one WebSocket to the app, over ASGI."""

    def __init__(self, settings: Settings, client: HoldingClient) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        scope = {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "scheme": "ws", "path": "/v1/stream", "raw_path": b"/v1/stream", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1:8080")], "client": ("10.0.0.9", 5555),
                 "server": ("127.0.0.1", 8080), "subprotocols": [], "state": {}}
        self.app = asyncio.create_task(create_app(settings, client)(scope, self.inbox.get, self.outbox.put))

    async def sent(self) -> dict[str, Any]:
        """The next ASGI message the app sent: a `websocket.send`'s JSON, else the message itself."""
        message = await asyncio.wait_for(self.outbox.get(), 5)
        return json.loads(message["text"]) if message["type"] == "websocket.send" else message

    def send(self, body: dict[str, object]) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(body)})

    async def leave(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(self.app, 5)


@pytest.mark.asyncio
async def test_a_socket_runs_at_most_ws_max_requests_at_once_and_refuses_the_rest_before_kafka() -> None:
    settings = bridge_settings(ws_max_requests=2)
    client = HoldingClient(settings)
    ws = Socket(settings, client)
    assert (await ws.sent())["type"] == "websocket.accept"
    for _ in range(3):
        ws.send(chat())
    answers = [await ws.sent() for _ in range(3)]
    assert [a["type"] for a in answers] == ["start", "start", "error"]
    refused = answers[2]
    assert (refused["id"], refused["code"], refused["param"], refused["retriable"]) == (None, "rate_limited", None, True)
    assert "ws_max_requests" in refused["message"]
    await asyncio.sleep(0.05)
    assert len(client.sent) == 2  # the refused one never reached Kafka
    client.answer_all()
    ended = [await ws.sent() for _ in range(6)]  # two chunks and done, for each
    assert sum(a["type"] == "done" for a in ended) == 2
    ws.send(chat())  # a request ended: room for another
    assert (await ws.sent())["type"] == "start"
    await ws.leave()


@pytest.mark.asyncio
async def test_a_socket_with_no_request_running_is_closed_after_ws_idle_s() -> None:
    settings = bridge_settings(ws_idle_s=IDLE_S)
    client = HoldingClient(settings)
    ws = Socket(settings, client)
    assert (await ws.sent())["type"] == "websocket.accept"
    ws.send(chat())
    assert (await ws.sent())["type"] == "start"
    await asyncio.sleep(IDLE_S * 3)  # a request running is not idle, however long it takes
    assert ws.outbox.empty() and not ws.app.done()
    client.answer_all()
    assert [(await ws.sent())["type"] for _ in range(3)] == ["chunk", "chunk", "done"]
    ended = asyncio.get_running_loop().time()
    closed = await ws.sent()
    assert (closed["type"], closed["code"]) == ("websocket.close", 1000)
    assert asyncio.get_running_loop().time() - ended >= IDLE_S * 0.9  # the idle clock starts when the last one ends
    ws.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})  # the client's close reply
    await asyncio.wait_for(ws.app, 5)


@pytest.mark.asyncio
async def test_a_socket_that_never_sends_a_request_is_closed_after_ws_idle_s() -> None:
    settings = bridge_settings(ws_idle_s=IDLE_S)
    ws = Socket(settings, HoldingClient(settings))
    assert (await ws.sent())["type"] == "websocket.accept"
    closed = await ws.sent()
    assert (closed["type"], closed["code"]) == ("websocket.close", 1000)
    ws.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await asyncio.wait_for(ws.app, 5)


@pytest.mark.parametrize(("auth_required", "code"), [
    (False, 1013),  # the credential cannot be checked now (the JWKS did not answer): try again later
    (True, 1008),  # none where one is required: a policy violation, as a foreign origin is refused
])
@pytest.mark.asyncio
async def test_without_a_denial_response_a_refused_handshake_is_a_close_before_accept(
    auth_required: bool, code: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def unanswered(self: Credentials, token: str | None) -> Credential:
        raise KeysAway("the identity provider's keys did not answer", 7.5)

    monkeypatch.setattr(Credentials, "resolve", unanswered)
    settings = with_gateway(auth_required=auth_required)
    ws = Socket(settings, HoldingClient(settings))
    closed = await ws.sent()
    assert (closed["type"], closed.get("code")) == ("websocket.close", code) and closed["reason"]
    await asyncio.wait_for(ws.app, 5)

"""The bridge's app on an SDK client whose Kafka is replaced by an in-memory answer: what it refuses
before anything reaches Kafka (bad bytes, foreign origins and Host headers), the cache directives it
passes on, and what it answers when the broker refuses a request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator

import pytest
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from starlette.testclient import TestClient

from pipeline.bridge.app import create_app
from pipeline.sdk import Client
from pipeline.settings import Settings
from topics.requests import Request
from topics.stream import Chunk, Done, FinishReason, Usage

SETTINGS = Settings()
MODEL = SETTINGS.models[0]
WS_URL = "ws://127.0.0.1:8080/v1/stream"  # websocket_connect ignores the base_url for a path
BAD_UTF8 = b'{"model":"m","messages":[{"role":"user","content":"\xff"}]}'


class AnsweringClient(Client):
    """Answers every request with two chunks and `done`, in memory; `refuse` makes producing fail."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, reply_name="bridge")
        self.sent: list[Request] = []
        self.refuse: KafkaError | None = None

    async def _produce(self, request: Request, headers: object = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append(request)
        asyncio.get_running_loop().call_soon(self._answer, request)

    def _answer(self, request: Request) -> None:
        stream = self._streams.get(request.id)
        if stream is None:
            return
        rid = f"default/{request.id}"
        for seq in range(2):
            stream._deliver(Chunk(id=rid, reply_to=request.reply_to, seq=seq, text=f"t{seq}", tenant="default"))
        stream._deliver(Done(id=rid, reply_to=request.reply_to, chunks=2, digest="", finish_reason=FinishReason.stop,
                             usage=Usage(1, 2), tenant="default", model=request.model, created_at=1.0))

    async def cancel(self, request_id: str, reason: object = None) -> None:
        pass


def chat(content: str = "hi") -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


@pytest.fixture
def bridge(request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, AnsweringClient]]:
    settings = getattr(request, "param", SETTINGS)
    client = AnsweringClient(settings)
    with TestClient(create_app(settings, client), base_url="http://127.0.0.1:8080") as http:
        yield http, client


def with_gateway(**changes: object) -> Settings:
    return dataclasses.replace(SETTINGS, gateway=dataclasses.replace(SETTINGS.gateway, **changes))


def test_a_body_with_bad_utf8_is_a_400_not_a_500(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    response = http.post("/v1/chat/completions", content=BAD_UTF8, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert client.sent == []


def test_every_cache_control_line_counts(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    headers = [("cache-control", "max-age=0"), ("cache-control", "no-store")]  # a proxy added the second line
    assert http.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200
    assert (client.sent[-1].no_cache, client.sent[-1].no_store) == (False, True)


def test_the_websocket_takes_cache_control_from_its_handshake(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    with http.websocket_connect(WS_URL, headers={"cache-control": "no-cache"}) as ws:
        ws.send_text(json.dumps(chat()))
        assert ws.receive_json()["type"] == "start"
        assert [ws.receive_json()["type"] for _ in range(3)] == ["chunk", "chunk", "done"]
    assert (client.sent[-1].no_cache, client.sent[-1].no_store) == (True, False)


def test_a_bad_websocket_message_is_refused_and_the_socket_keeps_serving(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    with http.websocket_connect(WS_URL) as ws:
        ws.send_bytes(BAD_UTF8)
        refused = ws.receive_json()
        assert (refused["type"], refused["id"], refused["code"]) == ("error", None, "invalid_request")
        ws.send_text(json.dumps(chat()))
        assert ws.receive_json()["type"] == "start"
        assert [ws.receive_json()["type"] for _ in range(3)] == ["chunk", "chunk", "done"]


def test_a_request_the_broker_refuses_is_a_503_with_retry_after(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    client.refuse = MessageSizeTooLargeError()
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={**chat(), "stream": stream})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "unavailable"


def test_a_page_on_another_origin_may_not_post_or_open_the_websocket(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    evil = {"origin": "http://evil.example"}
    response = http.post("/v1/chat/completions", json=chat(), headers=evil)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"
    with pytest.raises(Exception), http.websocket_connect(WS_URL, headers=evil) as ws:
        ws.receive_json()
    assert client.sent == []
    assert http.post("/v1/chat/completions", json=chat(), headers={"origin": "http://127.0.0.1:8080"}).status_code == 200
    assert http.post("/v1/chat/completions", json=chat()).status_code == 200  # no Origin: not a browser
    assert http.get("/v1/models", headers=evil).status_code == 200  # reading the model list is harmless


@pytest.mark.parametrize("bridge", [with_gateway(allowed_origins=("https://app.example.com",))], indirect=True)
def test_an_allowed_origin_may(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    origin = {"origin": "https://app.example.com"}
    assert http.post("/v1/chat/completions", json=chat(), headers=origin).status_code == 200
    with http.websocket_connect(WS_URL, headers=origin) as ws:
        ws.send_text(json.dumps(chat()))
        assert ws.receive_json()["type"] == "start"


def test_a_loopback_bridge_answers_loopback_names_only(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    rebound = {"host": "evil.example:8080", "origin": "http://evil.example:8080"}  # DNS rebinding: "same origin"
    assert http.post("/v1/chat/completions", json=chat(), headers=rebound).status_code == 400
    assert http.get("/v1/models", headers={"host": "evil.example:8080"}).status_code == 400
    assert http.get("/v1/models", headers={"host": "localhost:8080"}).status_code == 200
    assert client.sent == []


@pytest.mark.parametrize("bridge", [dataclasses.replace(SETTINGS, bridge=dataclasses.replace(SETTINGS.bridge, host="0.0.0.0"))],
                         indirect=True)
def test_a_bridge_on_every_address_answers_any_host_unless_configured(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    assert http.get("/v1/models", headers={"host": "api.example.com"}).status_code == 200
    # a page on another origin still may not post, and without a checked Host not even its "own" origin
    headers = {"host": "api.example.com", "origin": "http://api.example.com"}
    assert http.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 403

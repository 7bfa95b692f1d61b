"""The bridge's app on an SDK client whose Kafka is replaced by an in-memory answer: what it refuses
before anything reaches Kafka (bad bytes, features it does not do, foreign origins and Host headers),
`GET /v1/models/{id}`, the credential a WebSocket handshake must carry (a key that exists; 503 to retry
where it cannot be checked), the cache directives it passes on, what it answers when the broker refuses a
request, when a request takes and gives back its admission place (`bridge.max_in_flight`), the deadline
on a batch upload (`bridge.body_timeout_s`), and that the bridge's own limits are validated."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from starlette.testclient import TestClient, WebSocketDenialResponse

from pipeline.bridge import batches
from pipeline.bridge.app import create_app
from pipeline.bridge.credentials import Credential, Credentials, KeysAway
from pipeline.bridge.openai_format import Unauthorized
from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.keys import KeyEntry, KeyManager, MemoryKeyStore
from pipeline.sdk import Client
from pipeline.settings import Settings, SettingsError
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
            stream.deliver(Chunk(id=rid, reply_to=request.reply_to, seq=seq, text=f"t{seq}", tenant="default"))
        stream.deliver(Done(id=rid, reply_to=request.reply_to, chunks=2, digest="", finish_reason=FinishReason.stop,
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


def test_a_tool_call_request_is_a_400_naming_tools_not_a_plain_answer(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, client = bridge
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    response = http.post("/v1/chat/completions", json={**chat(), "tools": tools})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools" and response.json()["error"]["code"] == "invalid_request"
    assert client.sent == []


def test_a_field_past_the_wire_schemas_bounds_is_a_400_naming_it_over_http_and_the_websocket(
        bridge: tuple[TestClient, AnsweringClient]) -> None:
    """A model name over the schema's 256 characters passed the bridge's own checks and failed in
    `Client.request`: a 500 with a traceback over HTTP, and the end of the whole WebSocket."""
    http, client = bridge
    long_model = {**chat(), "model": "m" * 300}
    response = http.post("/v1/chat/completions", json=long_model)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model" and "m" * 300 not in response.text
    with http.websocket_connect(WS_URL) as ws:
        ws.send_text(json.dumps(long_model))
        refused = ws.receive_json()
        assert (refused["type"], refused["code"], refused["param"]) == ("error", "invalid_request", "model")
        ws.send_text(json.dumps(chat()))  # the socket keeps serving
        assert ws.receive_json()["type"] == "start"
        assert [ws.receive_json()["type"] for _ in range(3)] == ["chunk", "chunk", "done"]
    assert all(len(sent.model) <= 256 for sent in client.sent)


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


class Overflowing(AnsweringClient):
    """Answers with chunk 0, then seq 2..4099 behind a gap chunk 1 never fills: more than the SDK's
    sequencer holds (`MAX_HELD`)."""

    def _answer(self, request: Request) -> None:
        stream = self._streams.get(request.id)
        assert stream is not None
        for seq in (0, *range(2, 4100)):
            stream.deliver(Chunk(id=f"default/{request.id}", reply_to=request.reply_to, seq=seq, text="t", tenant="default"))


def test_a_stream_that_holds_too_much_behind_a_gap_ends_with_an_error_event_and_done() -> None:
    """The sequencer's OverflowError escaped the SDK as itself: the body ended with neither."""
    with TestClient(create_app(SETTINGS, Overflowing(SETTINGS)), base_url="http://127.0.0.1:8080") as http:
        response = http.post("/v1/chat/completions", json={**chat(), "stream": True})
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_incomplete"


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


SLASHED = dataclasses.replace(SETTINGS, backends=(*SETTINGS.backends,
                              dataclasses.replace(SETTINGS.backends[0], name="hub", model="org/model-7b", pool="hub")))


@pytest.mark.parametrize("bridge", [SLASHED], indirect=True)
def test_one_model_is_retrieved_by_its_id_even_one_holding_a_slash(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    listed = http.get("/v1/models").json()["data"]
    for item in listed:  # `client.models.retrieve(id)`: the same object as in the list
        response = http.get(f"/v1/models/{item['id']}")
        assert response.status_code == 200 and response.json() == item
    assert [item["id"] for item in listed] == [MODEL, "org/model-7b"]


def test_an_unknown_model_is_an_openai_404(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    response = http.get("/v1/models/gpt-4o")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["param"] == "model" and error["type"] == "invalid_request_error"
    assert "gpt-4o" in error["message"]


@pytest.mark.parametrize("bridge", [with_gateway(auth_required=True)], indirect=True)
def test_retrieving_a_model_needs_a_key_where_listing_them_does(bridge: tuple[TestClient, AnsweringClient]) -> None:
    http, _ = bridge
    assert http.get("/v1/models").status_code == 401
    response = http.get(f"/v1/models/{MODEL}")
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
    assert http.get("/v1/models/gpt-4o").status_code == 401  # not a 404: which models exist is for callers only


AUTH = with_gateway(auth_required=True)
MADE_UP_KEY = "sk-sluice-" + "A" * 16  # the right shape, but no such key


class CountingKeys(MemoryKeyStore):
    """The key store in memory, counting its lookups; with `away` they fail as with Redis down."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        self.away = False

    async def lookup(self, key_hash: str) -> KeyEntry | None:
        self.lookups += 1
        if self.away:
            raise StoreUnavailable("redis: ConnectionError")
        return await super().lookup(key_hash)


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> CountingKeys:
    """The bridge's key store (Redis) replaced with one in memory, for the apps the test creates."""
    store = CountingKeys()
    monkeypatch.setattr(batches, "RedisKeyStore", lambda redis: store)
    return store


def bearer(credential: str) -> dict[str, str]:
    return {"authorization": f"Bearer {credential}"}


def test_a_websocket_is_refused_at_its_handshake_unless_its_key_exists(keys: CountingKeys) -> None:
    """A made-up key of the right shape was accepted, and each message on its socket went into Kafka. A key
    that exists is looked up once for the socket, not for each message."""
    key, _ = asyncio.run(KeyManager(keys, rotate_overlap_s=60.0).create("acme"))
    with TestClient(create_app(AUTH, AnsweringClient(AUTH)), base_url="http://127.0.0.1:8080") as http:
        for headers in ({}, bearer(MADE_UP_KEY)):
            with pytest.raises(WebSocketDenialResponse) as refused, http.websocket_connect(WS_URL, headers=headers):
                pass
            assert refused.value.status_code == 401 and refused.value.json()["error"]["code"] == "unauthorized"
        keys.lookups = 0
        with http.websocket_connect(WS_URL, headers=bearer(key)) as ws:
            for _ in range(2):
                ws.send_text(json.dumps(chat()))
                assert [ws.receive_json()["type"] for _ in range(4)] == ["start", "chunk", "chunk", "done"]
    assert keys.lookups == 1  # at the handshake, not for each message


@pytest.mark.parametrize("away", ["identity provider", "key store"])
def test_a_websocket_whose_credential_cannot_be_checked_now_is_refused_with_a_503_to_retry(
    away: str, keys: CountingKeys, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The JWKS not answering (KeysAway) surfaced after the accept, where Starlette's handler sent an HTTP
    response on the accepted socket: a RuntimeError in the logs, 1006 for the client."""
    if away == "identity provider":
        async def unanswered(self: Credentials, token: str | None) -> Credential:
            raise KeysAway("the identity provider's keys did not answer", 7.5)

        monkeypatch.setattr(Credentials, "resolve", unanswered)
    keys.away = True
    with TestClient(create_app(AUTH, AnsweringClient(AUTH)), base_url="http://127.0.0.1:8080") as http:
        headers = bearer(MADE_UP_KEY)
        with pytest.raises(WebSocketDenialResponse) as refused, http.websocket_connect(WS_URL, headers=headers):
            pass
    assert refused.value.status_code == 503 and refused.value.json()["error"]["code"] == "unavailable"
    assert refused.value.headers["retry-after"] == ("8" if away == "identity provider" else "1")


class HoldingClient(AnsweringClient):
    """Answers a request only when the test calls `answer_all()`: until then its place stays taken."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.produced = asyncio.Event()

    async def _produce(self, request: Request, headers: object = None) -> None:
        self.sent.append(request)
        self.produced.set()

    def answer_all(self) -> None:
        for request in self.sent:
            self._answer(request)


ONE_PLACE = dataclasses.replace(SETTINGS, bridge=dataclasses.replace(SETTINGS.bridge, max_in_flight=1))


@contextlib.asynccontextmanager
async def asgi_bridge(settings: Settings, client: Client) -> AsyncIterator[httpx.AsyncClient]:
    """The app over httpx's ASGI transport, which hands the app a request body only as the test yields it."""
    transport = httpx.ASGITransport(create_app(settings, client))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080", timeout=10) as http:
        yield http


@pytest.mark.asyncio
async def test_a_full_bridge_is_a_503_with_retry_after_and_a_place_comes_back_when_an_answer_ends() -> None:
    client = HoldingClient(ONE_PLACE)
    async with asgi_bridge(ONE_PLACE, client) as http:
        held = asyncio.create_task(http.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(client.produced.wait(), 5)  # the one place is taken until it is answered
        refused = await http.post("/v1/chat/completions", json=chat())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "unavailable" and len(client.sent) == 1

        async def stalled() -> AsyncIterator[bytes]:
            yield b'{"model":'
            await asyncio.Event().wait()  # the rest never comes

        headers = {"content-type": "application/json"}
        refused = await asyncio.wait_for(http.post("/v1/chat/completions", content=stalled(), headers=headers), 5)
        assert refused.status_code == 503  # with no place free, at once: its body is not waited for
        client.answer_all()
        assert (await held).status_code == 200
        client.produced.clear()
        again = asyncio.create_task(http.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(client.produced.wait(), 5)
        client.answer_all()
        assert (await again).status_code == 200


@pytest.mark.parametrize("bearer", [None, "sk-sluice-" + "A" * 43])  # none needed; well-formed, looked up by ingest
@pytest.mark.asyncio
async def test_a_slow_upload_holds_no_place(bearer: str | None) -> None:
    arrived, rest = asyncio.Event(), asyncio.Event()
    body = json.dumps(chat()).encode()

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        arrived.set()
        await rest.wait()  # the uploader stalls (it may, up to bridge.body_timeout_s)
        yield body[10:]

    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {bearer}"} if bearer else {})
    async with asgi_bridge(ONE_PLACE, AnsweringClient(ONE_PLACE)) as http:
        uploading = asyncio.create_task(http.post("/v1/chat/completions", content=slowly(), headers=headers))
        await asyncio.wait_for(arrived.wait(), 5)
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200  # not 503
        rest.set()
        assert (await uploading).status_code == 200


@pytest.mark.asyncio
async def test_a_credential_being_checked_holds_no_place(monkeypatch: pytest.MonkeyPatch) -> None:
    checking, checked = asyncio.Event(), asyncio.Event()
    resolve = Credentials.resolve

    async def slow_for_one(self: Credentials, bearer: str | None) -> Credential:
        if bearer == "slow.jwt.token":  # as a JWT whose key the bridge fetches from a JWKS URL
            checking.set()
            await checked.wait()
            raise Unauthorized("the token is not valid")
        return await resolve(self, bearer)

    monkeypatch.setattr(Credentials, "resolve", slow_for_one)
    async with asgi_bridge(ONE_PLACE, AnsweringClient(ONE_PLACE)) as http:
        token = {"authorization": "Bearer slow.jwt.token"}
        slow = asyncio.create_task(http.post("/v1/chat/completions", json=chat(), headers=token))
        await asyncio.wait_for(checking.wait(), 5)
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200  # not 503
        checked.set()
        assert (await slow).status_code == 401
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200  # its refusal took no place


@pytest.mark.parametrize(("content", "headers"), [
    (BAD_UTF8, {}),  # refused as it is parsed, after it took its place
    (json.dumps(chat()).encode(), {"x-sluice-task": "Not A Task"}),
])
@pytest.mark.asyncio
async def test_a_request_refused_after_it_took_its_place_gives_it_back(content: bytes, headers: dict[str, str]) -> None:
    async with asgi_bridge(ONE_PLACE, AnsweringClient(ONE_PLACE)) as http:
        headers = {"content-type": "application/json", **headers}
        refused = await http.post("/v1/chat/completions", content=content, headers=headers)
        assert refused.status_code == 400
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200


def uploading(tmp_path: Path, body_timeout_s: float) -> Settings:
    return dataclasses.replace(SETTINGS, bridge=dataclasses.replace(SETTINGS.bridge, body_timeout_s=body_timeout_s),
                               batch=dataclasses.replace(SETTINGS.batch, dir=str(tmp_path)))


FORM_HEAD = (b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
             b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n')
FORM_HEADERS = {"content-type": "multipart/form-data; boundary=xyz"}


@pytest.mark.asyncio
async def test_an_upload_that_stalls_is_a_408_after_body_timeout_s(tmp_path: Path) -> None:
    async def stalled() -> AsyncIterator[bytes]:
        yield FORM_HEAD + b'{"custom_id":"a"}\n'
        await asyncio.Event().wait()  # the rest never comes

    settings = uploading(tmp_path, 0.3)
    async with asgi_bridge(settings, AnsweringClient(settings)) as http:
        refused = await asyncio.wait_for(http.post("/v1/files", content=stalled(), headers=FORM_HEADERS), 5)
    assert refused.status_code == 408
    assert refused.json()["error"]["code"] == "invalid_request"


@pytest.mark.asyncio
async def test_an_upload_that_keeps_coming_may_take_longer_than_body_timeout_s(tmp_path: Path) -> None:
    line = b'{"custom_id":"%d","method":"POST","url":"/v1/chat/completions","body":{}}\n'

    async def steadily() -> AsyncIterator[bytes]:  # about 100 KiB/s, over the floor of 64 KiB/s
        yield FORM_HEAD
        for piece in range(8):
            await asyncio.sleep(0.1)
            yield b"".join(line % (piece * 200 + i) for i in range(140))  # about 10 KiB
        yield b"\r\n--xyz--\r\n"

    settings = uploading(tmp_path, 0.3)
    async with asgi_bridge(settings, AnsweringClient(settings)) as http:
        response = await asyncio.wait_for(http.post("/v1/files", content=steadily(), headers=FORM_HEADERS), 5)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("change", "named"), [
    ({"ws_max_requests": 0}, "bridge.ws_max_requests"),
    ({"send_timeout_s": 0.0}, "bridge.send_timeout_s"),
    ({"ws_idle_s": float("nan")}, "ws_idle_s"),
])
def test_the_bridge_limits_are_validated(change: dict[str, object], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        bridge = dataclasses.replace(SETTINGS.bridge, **change)  # type: ignore[arg-type]
        dataclasses.replace(SETTINGS, bridge=bridge).validate()

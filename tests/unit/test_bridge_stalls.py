"""A client that stops reading (`bridge.send_timeout_s`, pipeline/bridge/edges.py `SendDeadline`): the
bridge served by `pipeline.bridge.serve` (uvicorn, its protocols) on 127.0.0.1 with an SDK client whose Kafka
is replaced by an in-memory answer far larger than any socket buffer. The client sends its request and then
reads nothing; the bridge must end the connection, cancel the request in the pipeline and give its
admission place back, instead of waiting in a send for ever. And, with the bridge's protocols alone,
uvicorn's WebSocket keepalive, whose close after an unanswered ping waited on the same drain, and a client
that sends pings and reads none of the pongs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.bridge import serve
from pipeline.bridge.edges import head_limited_protocol, websocket_protocol
from pipeline.sdk import Client
from pipeline.settings import Settings
from tests.ports import free_port
from topics.requests import Request
from topics.stream import Chunk, Done, FinishReason, Usage

SEND_TIMEOUT_S = 0.3
BASE = Settings()
SETTINGS = dataclasses.replace(
    BASE,
    # one admission place: a stalled request that keeps its place shows as a 503 for the next one
    bridge=dataclasses.replace(BASE.bridge, send_timeout_s=SEND_TIMEOUT_S, max_in_flight=1),
    batch=dataclasses.replace(BASE.batch, run_in_bridge=False),
)
MODEL = SETTINGS.models[0]
CHUNK_TEXT = "x" * 16384
FLOOD = 1000  # chunks of 16 KiB: far more than the kernel's and the transport's buffers hold


class FloodingClient(Client):
    """Answers its first request with FLOOD large chunks and no end (the model is still generating); any
    later one with one chunk and `done`. Records the cancellations the SDK stream's cleanup sends."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, reply_name="bridge")
        self.sent: list[Request] = []
        self.cancelled: list[str] = []
        self.cancelled_event = asyncio.Event()

    async def _produce(self, request: Request, headers: object = None) -> None:
        self.sent.append(request)
        asyncio.get_running_loop().call_soon(self._answer, request, len(self.sent) == 1)

    def _answer(self, request: Request, flood: bool) -> None:
        stream = self._streams.get(request.id)
        if stream is None:
            return
        rid = f"default/{request.id}"
        for seq in range(FLOOD if flood else 1):
            stream.deliver(Chunk(id=rid, reply_to=request.reply_to, seq=seq, text=CHUNK_TEXT, tenant="default"))
        if not flood:
            stream.deliver(Done(id=rid, reply_to=request.reply_to, chunks=1, digest="", tenant="default",
                                 finish_reason=FinishReason.stop, usage=Usage(1, 1), model=request.model,
                                 created_at=1.0))

    async def cancel(self, request_id: str, reason: object = None) -> None:
        self.cancelled.append(request_id)
        self.cancelled_event.set()


@contextlib.asynccontextmanager
async def served(client: Client) -> AsyncIterator[int]:
    """The bridge on a free port until the block ends."""
    port = free_port()
    settings = dataclasses.replace(SETTINGS, bridge=dataclasses.replace(SETTINGS.bridge, port=port))
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(settings, client, stop))
    for _ in range(500):
        if serving.done():
            serving.result()
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            break
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        stop.set()
        await asyncio.wait_for(serving, 15)


async def connected(port: int) -> socket.socket:
    """A connection with a small receive buffer, so what the bridge writes backs up at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


def chat(stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()


def masked_text_frame(payload: bytes) -> bytes:
    """A WebSocket text frame as a client sends it (masked; payload under 64 KiB)."""
    mask = os.urandom(4)
    size = len(payload)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return b"\x81" + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def place_is_free(port: int) -> None:
    """Another request is answered (with bridge.max_in_flight = 1: the stalled one gave its place back)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        response = await http.post("/v1/chat/completions", content=chat(False),
                                   headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.asyncio
async def test_an_sse_client_that_stops_reading_loses_the_connection_and_its_request_is_cancelled() -> None:
    client = FloodingClient(SETTINGS)
    async with served(client) as port:
        loop = asyncio.get_running_loop()
        with await connected(port) as sock:
            body = chat(True)
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            await loop.sock_sendall(sock, head + body)  # and then reads nothing
            await asyncio.wait_for(client.cancelled_event.wait(), SEND_TIMEOUT_S + 5)
            assert client.cancelled == [f"default/{client.sent[0].id}"]
            await place_is_free(port)


@pytest.mark.asyncio
async def test_a_websocket_client_that_stops_reading_loses_the_socket_and_its_requests_are_cancelled() -> None:
    client = FloodingClient(SETTINGS)
    async with served(client) as port:
        loop = asyncio.get_running_loop()
        with await connected(port) as sock:
            handshake = (f"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                         "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                         "Sec-WebSocket-Version: 13\r\n\r\n").encode()
            await loop.sock_sendall(sock, handshake)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await asyncio.wait_for(loop.sock_recv(sock, 1), 5)  # the 101, byte by byte: nothing after it
            assert answer.startswith(b"HTTP/1.1 101")
            await loop.sock_sendall(sock, masked_text_frame(chat(True)))  # and then reads nothing
            await asyncio.wait_for(client.cancelled_event.wait(), SEND_TIMEOUT_S + 5)
            assert client.cancelled == [f"default/{client.sent[0].id}"]
            await place_is_free(port)


@pytest.mark.asyncio
async def test_a_websocket_whose_ping_goes_unanswered_behind_unread_data_is_aborted_at_once() -> None:
    """uvicorn's keepalive: no pong within the timeout, so it writes a close frame and closes; a close waits
    for the buffer to drain, which a client that reads nothing never lets happen. Long before the send
    timeout (60 s here), the socket must end and the app's blocked send with it."""
    gone = asyncio.Event()

    async def flood(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                await websocket.send_bytes(b"x" * 65536)
        except WebSocketDisconnect:
            gone.set()

    async with websocket_server(flood, websocket_protocol(60.0), ws_ping_interval=0.2, ws_ping_timeout=0.2) as port:
        with await connected(port) as sock:
            await upgrade(sock, port)  # and then reads nothing
            await asyncio.wait_for(gone.wait(), 5)


@contextlib.asynccontextmanager
async def websocket_server(endpoint: object, ws: object, **config: object) -> AsyncIterator[int]:
    """A uvicorn server with the bridge's HTTP protocol and `ws`, serving `endpoint` at "/"; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[WebSocketRoute("/", endpoint)]), host="127.0.0.1", port=port,  # type: ignore[arg-type]
        http=head_limited_protocol(10.0, 16384, 60.0), ws=ws, log_level="error", lifespan="off", **config))  # type: ignore[arg-type]
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await serving


async def upgrade(sock: socket.socket, port: int) -> None:
    """Sends a WebSocket handshake on `sock`."""
    await asyncio.get_running_loop().sock_sendall(sock, (
        f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())


def masked_ping_frame(payload: bytes) -> bytes:
    """A WebSocket ping as a client sends it (masked; a control frame's payload is at most 125 bytes)."""
    mask = os.urandom(4)
    return b"\x89" + bytes([0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


PINGS = 8 * 1024 * 1024  # bytes of pings the client tries to send, reading none of the pongs
MOST_BUFFERED = 1024 * 1024  # the high-water mark (64 KiB) plus one read (256 KiB) of pings answered, with room


@pytest.mark.asyncio
async def test_a_websocket_client_that_pings_and_reads_nothing_cannot_grow_the_write_buffer() -> None:
    """uvicorn answers each ping with a pong written at once, which never waits for the buffer to drain: a
    client sending pings and reading nothing grew the bridge's write buffer by megabytes a second until the
    send deadline (60 s here). The bridge must stop reading instead, so the pings back up on the client."""
    peak = 0

    class Watched(websocket_protocol(60.0)):  # type: ignore[misc, valid-type]
        def handle_ping(self) -> None:
            nonlocal peak
            super().handle_ping()
            peak = max(peak, self.transport.get_write_buffer_size())

    async def hold(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.receive()  # the client's going

    async with websocket_server(hold, Watched, ws_ping_interval=None) as port:
        loop = asyncio.get_running_loop()
        with await connected(port) as sock:
            await upgrade(sock, port)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await asyncio.wait_for(loop.sock_recv(sock, 1), 5)
            assert answer.startswith(b"HTTP/1.1 101")
            burst = masked_ping_frame(b"p" * 125) * 512  # 67 KiB of pings
            sent = 0
            with contextlib.suppress(TimeoutError):  # the bridge stopped reading: the kernel's buffers are full
                while sent < PINGS:
                    await asyncio.wait_for(loop.sock_sendall(sock, burst), 1.0)
                    sent += len(burst)
            await asyncio.sleep(0.2)  # the bridge answers what it has read
            assert peak < MOST_BUFFERED, f"{peak} bytes of pongs buffered after {sent} bytes of pings"

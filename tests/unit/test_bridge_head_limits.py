"""The bridge's HTTP protocol (`pipeline.bridge.edges.head_limited_protocol`, uvicorn's httptools one):
a request head that is too slow or too large ends the connection; bodies, keep-alive and pipelined
requests are not mistaken for either. A real uvicorn server on 127.0.0.1, nothing behind it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pipeline.bridge.edges import head_limited_protocol
from tests.ports import free_port

TIMEOUT_S = 0.4
MAX_HEAD = 1024


async def echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    if request.url.path == "/slow":
        await asyncio.sleep(TIMEOUT_S * 1.5)
    return PlainTextResponse(f"{request.url.path} {len(body)}")


@pytest_asyncio.fixture
async def port() -> AsyncIterator[int]:
    free = free_port()
    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST"]) for p in ("/fast", "/slow")])
    config = uvicorn.Config(app, host="127.0.0.1", port=free, http=head_limited_protocol(TIMEOUT_S, MAX_HEAD),
                            log_level="error", lifespan="off", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield free
    server.should_exit = True
    await serving


async def answers(reader: asyncio.StreamReader, count: int) -> list[bytes]:
    """`count` responses' bodies (plain text with a content length), in order."""
    bodies = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line[15:]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        bodies.append(await reader.readexactly(length))
    return bodies


async def closed(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the server sent before it closed the connection (fails if it stays open `within_s`)."""
    return await asyncio.wait_for(reader.read(), within_s)


@pytest.mark.asyncio
@pytest.mark.parametrize("answered_first", [False, True], ids=["first head", "next head on a kept-alive connection"])
async def test_a_head_that_does_not_complete_in_time_closes_the_connection(port: int, answered_first: bool) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if answered_first:
        writer.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await answers(reader, 1) == [b"/fast 0"]
    writer.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # and nothing more
    assert await closed(reader, TIMEOUT_S * 5) == b""
    writer.close()


@pytest.mark.asyncio
async def test_a_head_over_the_bound_in_pieces_is_a_400_and_the_end_of_the_connection(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n")
    for _ in range(MAX_HEAD // 100):  # each line on its own, quickly: the head passes the bound with the last
        await asyncio.sleep(0.01)
        writer.write(b"X-Pad: " + b"a" * 93 + b"\r\n")
    refused = await closed(reader, TIMEOUT_S)  # at once, not at the head's deadline (that one sends nothing)
    assert refused.startswith(b"HTTP/1.1 400") and refused.endswith(b"Request head too large.")
    writer.close()


@pytest.mark.asyncio
async def test_a_body_is_not_head_and_pipelined_requests_are_all_answered(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"b" * (MAX_HEAD * 4)  # in the same write as its head
    writer.write(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert await answers(reader, 1) == [b"/fast 4096"]
    # Two slow requests in one write: the second's head is read while the first runs, so no deadline may
    # be set for a "next head" when the first answer ends (it would cut the second off mid-way).
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await answers(reader, 2) == [b"/slow 0", b"/slow 0"]
    writer.close()

"""What the bridge checks before any route runs.

    AllowedHosts             the Host header (`gateway.allowed_hosts`; on a loopback address, loopback names only)
    BrowserOrigins           what a web page may send or open (`gateway.allowed_origins`)
    head_limited_protocol    uvicorn's httptools protocol with a deadline and a size bound on each request head,
                             and a deadline on a blocked write (`bridge.send_timeout_s`)
    websocket_protocol       uvicorn's WebSocket protocol with the same deadline on a blocked write, and no
                             reading while the answers to a client's pings fill the write buffer
    metrics_allowed          who may read /metrics on the API port

Starlette's TrustedHostMiddleware compares only the host part of the header, so an entry with a port
(`127.0.0.1:8092`) never matched and every request was refused; `AllowedHosts` understands both forms
(pipeline/gateway/hosts.py) and answers a refusal in OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from pipeline.bridge.openai_format import error_body
from pipeline.gateway.hosts import allowed, parse_entry
from pipeline.observability.config import bearer_matches
from topics.errors import ErrorCode

if TYPE_CHECKING:
    from uvicorn._types import ASGIReceiveEvent

log = logging.getLogger(__name__)


class AllowedHosts:
    """Refuses a request whose Host header no entry allows: 400 over HTTP, a refused WebSocket handshake."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...]) -> None:
        self.app = app
        self.entries = tuple(parse_entry(h) for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not allowed(Headers(scope=scope).get("host", ""), self.entries):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await JSONResponse(error_body("invalid Host header", code=ErrorCode.invalid_request), status_code=400)(scope, receive, send)
            return
        await self.app(scope, receive, send)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # what a bridge on a loopback address answers by default
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def default_hosts(bind_host: str) -> tuple[str, ...]:
    """The Host headers to answer when `gateway.allowed_hosts` is empty: loopback names for a bridge on a
    loopback address (a web page that rebinds its own DNS name to 127.0.0.1 gets nothing), any otherwise."""
    try:
        loopback = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        loopback = bind_host == "localhost"
    return LOOPBACK_HOSTS if loopback else ()


class BrowserOrigins:
    """Refuses what a web page on another origin sends: a WebSocket handshake or a POST, PUT, PATCH or
    DELETE whose `Origin` header (browsers set it; other clients do not) is neither in
    `gateway.allowed_origins` nor the bridge's own origin. Browsers apply no same-origin rule to
    WebSockets, and a form or a `text/plain` fetch can POST without a CORS preflight: without this, any
    page a local user opens could run and read requests on a bridge without auth. The bridge's own
    origin counts only where the Host header was checked (`AllowedHosts`), so a rebound DNS name does
    not make a page "same origin". 403 over HTTP, a refused handshake over WebSocket."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...], hosts_checked: bool) -> None:
        self.app = app
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)
        self.hosts_checked = hosts_checked

    def allowed(self, headers: Headers) -> bool:
        origin = headers.get("origin")
        if origin is None:
            return True  # not a browser's cross-site request
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        _, sep, netloc = origin.partition("://")
        return bool(sep) and self.hosts_checked and netloc == headers.get("host", "").lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if (kind == "websocket" or (kind == "http" and scope["method"] in UNSAFE_METHODS)) and not self.allowed(
            Headers(scope=scope)
        ):
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            body = error_body("this origin may not use the API (gateway.allowed_origins)", code=ErrorCode.forbidden)
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class SendDeadline(asyncio.Protocol):
    """A write to the client that stays blocked `send_timeout_s` ends the connection (nginx's send_timeout).

    uvicorn's `send` waits for the transport's buffer to drain (`pause_writing` until `resume_writing`) with
    no bound, so a client that stops reading held its response, its request and its admission place for
    ever: the SDK stream checks the request's deadline only between events, never while the relay waits in
    a send. One timer per paused write (none on the hot path, where the buffer never fills): if the buffer
    has not drained below its low-water mark by then, the transport is aborted, not closed (a close waits
    for the same drain). The connection is then lost: uvicorn answers the app's `receive()` with a
    disconnect, the relay (or the WebSocket session) cancels its requests, and each gives its place back."""

    send_timeout_s: float | None = None  # None: no deadline
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _send_timer: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None and self.send_timeout_s is not None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    def _send_timed_out(self) -> None:
        self._send_timer = None
        log.info("a client read nothing for %g s: its connection is aborted", self.send_timeout_s)
        self.transport.abort()


def head_limited_protocol(
    timeout_s: float, max_head_bytes: int, send_timeout_s: float | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (llhttp, in C: about half the CPU per request of its h11 protocol,
    bench/http_protocol.py), with two limits on each request head. A connection whose next head is not
    complete `timeout_s` after the connection opened or the previous response ended is closed: uvicorn's
    own `timeout_keep_alive` stops at the first byte, so a client sending its headers a byte a second held
    a connection forever. A head still incomplete past `max_head_bytes` gets a 400 and the connection is
    closed: llhttp itself bounds neither, and a head that arrives whole is refused with 431 by the app
    (`HeaderLimit`). With `send_timeout_s`, a response write blocked that long ends the connection
    (`SendDeadline`)."""

    class HeadLimitedProtocol(SendDeadline, HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes: int | None = 0  # bytes read of the head under way; None between a head's end and the next

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._expect_head()  # (else a pipelined request, its head read already, has just started)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_bytes is None or self.transport.is_closing():
                return
            self._head_bytes += len(data)  # all of it was head: the head is still not complete
            if self._head_bytes > max_head_bytes:
                self.send_400_response("Request head too large.")

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _expect_head(self) -> None:
            self._head_bytes = 0
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._head_bytes is not None and not self.transport.is_closing():
                self.transport.close()

    HeadLimitedProtocol.send_timeout_s = send_timeout_s
    return HeadLimitedProtocol


def websocket_protocol(send_timeout_s: float) -> type[WebSocketsSansIOProtocol]:
    """uvicorn's WebSocket protocol (the one its "auto" picks) with `SendDeadline` on every write, and no
    close that waits for ever: when a keepalive ping goes unanswered uvicorn writes a close frame and
    closes, and a close waits for the buffer to drain, so behind data the client does not read the
    connection (and the session's `receive()`) never ended; such a close is an abort. A connection still
    open `send_timeout_s` after the app returned and uvicorn's closing handshake timed out is aborted too.
    While the pongs answering a client's pings hold the write buffer over its high-water mark, the connection
    reads nothing more (`handle_ping`)."""

    class SendLimitedWebSocket(SendDeadline, WebSocketsSansIOProtocol):
        _end_timer: asyncio.TimerHandle | None = None
        _pongs_backed_up = False  # reading paused: answers to the client's pings fill the write buffer

        def handle_ping(self) -> None:
            """uvicorn answers each ping with a pong written at once, never waiting for the buffer to drain
            (only the app's sends wait): a client sending pings and reading nothing grew the buffer by
            megabytes a second until the send deadline. Once a pong is written with the buffer over its
            high-water mark (the bound the app's data has: the transport called `pause_writing`), the
            connection stops reading until the buffer drains below its low-water mark, so the pings back
            up in the client's own socket, as TCP would have it. Paused rather than aborted: a client that
            pings while it reads a large answer slowly is not at fault, and one that never reads is still
            aborted by the send deadline. The buffer stays under the mark plus one read (up to 256 KiB of
            pings, answered together)."""
            super().handle_ping()
            if not self.writable.is_set() and not self._pongs_backed_up:
                self._pongs_backed_up = True
                self.transport.pause_reading()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._pongs_backed_up:
                self._pongs_backed_up = False
                if not self.read_paused:  # (else uvicorn resumes once the app has taken the message it holds)
                    self.transport.resume_reading()

        async def receive(self) -> ASGIReceiveEvent:
            message = await super().receive()
            if self._pongs_backed_up:  # uvicorn resumed reading as the app took its message: not yet
                self.transport.pause_reading()
            return message

        def keepalive_timeout(self) -> None:
            super().keepalive_timeout()
            if self.transport.get_write_buffer_size():  # the close frame waits behind bytes the client does not read
                self.transport.abort()

        async def run_asgi(self) -> None:
            await super().run_asgi()
            if not self.disconnected:
                self._end_timer = self.loop.call_later(self.close_timeout + send_timeout_s, self.transport.abort)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._end_timer is not None:
                self._end_timer.cancel()
                self._end_timer = None
            super().connection_lost(exc)

    SendLimitedWebSocket.send_timeout_s = send_timeout_s
    return SendLimitedWebSocket


def metrics_allowed(connection: HTTPConnection, token: str, auth_required: bool) -> bool:
    """With a metrics token, only a bearer of it; without one, everyone unless auth is required."""
    if not token:
        return not auth_required
    return bearer_matches(connection.headers.get("authorization", ""), token)


__all__ = [
    "AllowedHosts", "BrowserOrigins", "SendDeadline", "default_hosts", "head_limited_protocol", "metrics_allowed",
    "websocket_protocol",
]

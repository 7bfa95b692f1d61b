"""What the bridge checks before any route runs.

    AllowedHosts             the Host header (`gateway.allowed_hosts`)
    head_timeout_protocol    uvicorn's h11 protocol with a deadline on each request head
    metrics_allowed          who may read /metrics on the API port

Starlette's TrustedHostMiddleware compares only the host part of the header, so an entry with a port
(`127.0.0.1:8092`) never matched and every request was refused; `AllowedHosts` understands both forms
(pipeline/gateway/hosts.py) and answers a refusal in OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import hmac

import h11
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.bridge.openai_format import error_body
from pipeline.gateway.hosts import allowed, parse_entry
from topics.errors import ErrorCode


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


def head_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete `timeout_s` after
    the connection opened or the previous response ended. uvicorn's own `timeout_keep_alive` stops at
    the first byte, so a client sending its headers a byte a second held a connection forever."""

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._head_timer is not None:  # the head is complete
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


def metrics_allowed(connection: HTTPConnection, token: str, auth_required: bool) -> bool:
    """With a metrics token, only a bearer of it; without one, everyone unless auth is required."""
    if not token:
        return not auth_required
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


__all__ = ["AllowedHosts", "head_timeout_protocol", "metrics_allowed"]

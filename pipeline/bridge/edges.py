"""What the bridge checks before any route runs: the Host header (`gateway.allowed_hosts`).

Starlette's TrustedHostMiddleware compares only the host part of the header, so an entry with a port
(`127.0.0.1:8092`) never matched and every request was refused; `AllowedHosts` understands both forms
(pipeline/gateway/hosts.py) and answers a refusal in OpenAI's error format.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

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


__all__ = ["AllowedHosts"]

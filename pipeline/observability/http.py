"""The bridge's SERVER span: the root of every HTTP API request's trace (the SDK's request span, and
through it every stage's, is its child). Only the API (`/v1/...`) is traced; a WebSocket carries many
requests over one connection, so each of its requests is a trace of its own rooted at the SDK's span."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline import tracing

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})  # span names stay bounded


class TraceRequests:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        route = path if path in ROUTES else "/v1/other"
        method = scope.get("method", "GET")
        span = tracing.tracer.start_span(f"{method} {route}", kind=trace.SpanKind.SERVER, attributes={
            "http.request.method": method, "http.route": route, "url.scheme": scope.get("scheme", "http"),
        })

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):  # 5xx: above
            await self.app(scope, receive, sending)

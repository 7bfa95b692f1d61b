"""The bridge's Starlette app: an OpenAI-compatible HTTP API and a WebSocket, both on the SDK.

    POST /v1/chat/completions   chat; `stream: true` answers with server-sent events (relay.py)
    POST /v1/completions        the same for a plain prompt
    GET  /v1/models             the configured models, in OpenAI's list format
    GET  /v1/models/{id}        one of them (an id may hold "/"), or 404 `not_found`
    WS   /v1/stream             many chat requests over one socket (websocket.py)
    GET  /healthz, /metrics     liveness, Prometheus text format (/metrics: see edges.metrics_allowed)

Every request goes through `Client`, so it takes the same path as any other: ingest checks the model,
the limits and (later) the API key, and its refusals come back as error terminal events that the
bridge turns into OpenAI errors with the status from `topics.errors.http_status`. The bridge itself
refuses only what it cannot parse, bodies over `body_cap()`, credentials it can tell are bad
(credentials.py; a WebSocket's at its handshake, its key looked up where auth is required), requests
over `bridge.max_in_flight` (admission.py), and WebSocket messages past `bridge.ws_max_requests`
running on their socket (websocket.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from pipeline.bridge import dashboard
from pipeline.bridge.admission import Admission
from pipeline.bridge.credentials import Credentials
from pipeline.bridge.edges import AllowedHosts, BrowserOrigins, default_hosts, metrics_allowed
from pipeline.bridge.openai_format import (
    BadRequest,
    BridgeError,
    Json,
    NotFound,
    Parsed,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    decode_body,
    error_body,
    model_body,
    models_body,
    parse_chat,
    parse_completion,
    validated,
)
from pipeline.bridge.relay import RelayResponse
from pipeline.bridge.websocket import StreamSession
from pipeline.gateway.network import attest
from pipeline.observability.http import TraceRequests
from pipeline.observability.siblings import Siblings
from pipeline.sdk import Client
from pipeline.settings import LimitSettings, Settings
from topics.errors import ErrorCode, retriable
from topics.requests import Request

log = logging.getLogger(__name__)

Parser = Callable[[Json], Parsed]
MAX_HEADER_BYTES = 16 * 1024  # a request whose headers are larger is refused with 431 before any route runs
Endpoint = Callable[[HttpRequest], Awaitable[Response]]


def body_cap(limits: LimitSettings) -> int:
    """The largest request body the bridge reads: twice the prompt limit (JSON escaping) plus 16 KiB."""
    return limits.max_prompt_bytes * 2 + 16 * 1024


def create_app(settings: Settings, client: Client, *, owns_client: bool = False, siblings: Siblings | None = None) -> Starlette:
    """The bridge on `client`. With `owns_client` the app's lifespan starts and stops the client;
    otherwise the caller does, around the app's whole life. `siblings`: the other processes serving the
    same port (`sluice run`), whose metrics /metrics and /dashboard answer for too."""
    cap = body_cap(settings.limits)
    from pipeline.bridge.batches import BatchApi  # here: pipeline.batch imports openai_format, i.e. this package

    credentials = Credentials(settings.gateway)
    admission = Admission(settings.bridge.max_in_flight)  # requests open at once in this process (admission.py)
    batches = BatchApi(settings, client, credentials)  # /v1/files, /v1/batches and the job worker (batches.py)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_client:
            await client.start()
        try:
            async with batches.running():
                yield
        finally:
            if owns_client:
                await client.stop()

    auth_required = settings.gateway.auth_required

    async def models(request: HttpRequest) -> Response:
        if auth_required:  # a key that is valid, not merely present: the model list is for callers only
            await batches.owner(request)
        return JSONResponse(models_body(settings.models))

    async def model(request: HttpRequest) -> Response:
        if auth_required:  # as the list: what is served is for callers only
            await batches.owner(request)
        model_id = request.path_params["model_id"]
        if model_id not in settings.models:
            raise NotFound(f"the model `{model_id}` does not exist", "model")
        return JSONResponse(model_body(model_id))

    async def stream(websocket: WebSocket) -> None:
        # The credential is checked in full before the handshake is accepted, once for the socket: a JWT
        # verified, and where auth is required a key looked up (as for /v1/models). A made-up key of the
        # right shape passed the shape check, and each of its messages went into Kafka to be refused by ingest.
        try:
            require_credential(websocket, auth_required)
            credential = await credentials.resolve(bearer_token(websocket))
            if auth_required:
                await batches.owner_of_credential(credential)
        except BridgeError as exc:  # 401, or 503 where the JWKS or the key store did not answer
            await refuse_handshake(websocket, exc)
            return
        await websocket.accept()
        secret = settings.gateway.client_info_secret
        no_cache, no_store = cache_directives(websocket)  # the handshake's, for every request on the socket

        def prepare(request: Request) -> Request:
            request = msgspec.structs.replace(request, no_cache=no_cache, no_store=no_store)
            return credential.apply(with_client_info(request, websocket, secret))  # signed last

        await StreamSession(websocket, client, cap, prepare, admission, max_requests=settings.bridge.ws_max_requests,
                            idle_s=settings.bridge.ws_idle_s).run()

    async def metrics(request: HttpRequest) -> Response:
        if not metrics_allowed(request, settings.bridge.metrics_token, auth_required):
            if settings.bridge.metrics_token:
                raise Unauthorized("/metrics needs its bearer token")
            raise HTTPException(404, "Not Found")
        return Response(await siblings.metrics() if siblings else generate_latest(), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/chat/completions", _completions(client, parse_chat, cap, settings, credentials, admission), methods=["POST"]),
        Route("/v1/completions", _completions(client, parse_completion, cap, settings, credentials, admission), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),  # :path, as an id may hold "/"
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        WebSocketRoute("/v1/stream", stream),
        *dashboard.routes(settings, siblings),  # /dashboard: live charts on the same metrics (dashboard.py)
        *batches.routes(),
    ]
    handlers = {BridgeError: _bridge_error, HTTPException: _http_error, Exception: _internal_error}
    hosts = settings.gateway.allowed_hosts or default_hosts(settings.bridge.host)
    middleware = [Middleware(HeaderLimit, limit=MAX_HEADER_BYTES), Middleware(TraceRequests)]
    middleware += [Middleware(AllowedHosts, hosts=hosts)] if hosts else []
    middleware += [Middleware(BrowserOrigins, origins=settings.gateway.allowed_origins, hosts_checked=bool(hosts))]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware)  # type: ignore[arg-type]


def _completions(
    client: Client, parse: Parser, cap: int, settings: Settings, credentials: Credentials, admission: Admission,
) -> Endpoint:
    async def endpoint(request: HttpRequest) -> Response:
        # The credential (as far as the bridge checks it) and the whole body come before a place is taken:
        # a caller without a credential, a slow token check or a slow upload holds none (admission.py).
        require_credential(request, settings.gateway.auth_required)  # before the body is read or validated
        credential = await credentials.resolve(bearer_token(request))
        admission.check()  # none free: 503 now, before the body is read
        body = await read_capped(request, cap, settings.bridge.body_timeout_s)
        admission.enter()  # over the bound (filled while the body came): 503, before anything reaches Kafka
        try:
            parsed = parse(decode_body(body))
            no_cache, no_store = cache_directives(request)
            sdk_request = validated(lambda: client.request(**parsed.request_kwargs(), no_cache=no_cache, no_store=no_store,
                                                           task=task_header(request)))
            sdk_request = with_client_info(sdk_request, request, settings.gateway.client_info_secret)
            sdk_request = credential.apply(sdk_request)  # signed last: the token covers the rest
        except BaseException:
            admission.leave()
            raise
        return RelayResponse(client, sdk_request, parsed, on_end=admission.leave)  # which leaves its place when sent

    return endpoint


class HeaderLimit:
    """Refuses a request whose headers total more than `limit` bytes: 431 over HTTP, a refused handshake
    over WebSocket. (The protocol's bound, `edges.head_limited_protocol`, covers only a head that arrives
    in pieces.)"""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and sum(len(k) + len(v) for k, v in scope["headers"]) > self.limit:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1009})
                return
            body = error_body(f"the request headers are over {self.limit} bytes", code=ErrorCode.invalid_request)
            await JSONResponse(body, status_code=431)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def refuse_handshake(websocket: WebSocket, exc: BridgeError) -> None:
    """Refuses a WebSocket before it is accepted, as the same error over HTTP is answered: its status, body
    and headers (401; 503 with `Retry-After`), where the server has ASGI's denial response extension
    (uvicorn has). Elsewhere a close before accept (which the server answers with 403): 1013, "try again
    later", for an error a retry may pass, else 1008, as `edges.BrowserOrigins` refuses."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers))
        return
    reason = exc.message.encode()[:123].decode(errors="ignore")  # a close frame's reason holds 123 bytes
    await websocket.close(1013 if retriable(exc.code) else 1008, reason)


TASK = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")


def task_header(request: HttpRequest) -> str | None:
    """`x-sluice-task` (code, summarization, ...), which routing rules may match on."""
    task = request.headers.get("x-sluice-task")
    if task is not None and not TASK.match(task):
        raise BadRequest("`x-sluice-task` must be 1-32 lower-case letters, digits, '-' or '_'", "x-sluice-task")
    return task


def cache_directives(connection: HTTPConnection) -> tuple[bool, bool]:
    """(no-cache, no-store) from the `Cache-Control` request headers, every line of them (a proxy may add
    one): do not answer from the cache, do not store the answer in it."""
    header = ",".join(connection.headers.getlist("cache-control"))
    directives = {d.strip().split("=", 1)[0].lower() for d in header.split(",")}
    return "no-cache" in directives, "no-store" in directives


def with_client_info(sdk_request: Request, connection: HTTPConnection, secret: str) -> Request:
    """The request with the caller's address and user agent, signed for ingest's network rules.

    The address is the TCP peer's: uvicorn runs without proxy headers, so X-Forwarded-For is ignored."""
    ip = connection.client.host if connection.client else None
    agent = connection.headers.get("user-agent")
    agent = agent[:512] if agent is not None else None
    signature = attest(secret, sdk_request.id, ip, agent) if secret else None
    return msgspec.structs.replace(sdk_request, client_ip=ip, user_agent=agent, client_attestation=signature)


async def read_capped(request: HttpRequest, cap: int, timeout_s: float | None = None) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be over `cap` bytes, and with 408 if it
    has not all arrived within `timeout_s`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {cap}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                body += piece
                if len(body) > cap:
                    raise PayloadTooLarge(f"the request body is over the limit of {cap} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    return bytes(body)


def require_credential(connection: HTTPConnection, auth_required: bool) -> None:
    """Where auth is required, a request without a credential is refused before anything else is looked at
    (ingest verifies the credential, also before it validates the request)."""
    if auth_required and bearer_token(connection) is None:
        raise Unauthorized("an API key is required (Authorization: Bearer sk-sluice-...)")


def bearer_token(connection: HTTPConnection) -> str | None:
    """The credential from `Authorization: Bearer <key>`, for credentials.py; never logged."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def _healthz(request: HttpRequest) -> Response:
    return JSONResponse({"status": "ok"})


async def _bridge_error(request: HTTPConnection, exc: Exception) -> Response:
    assert isinstance(exc, BridgeError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: HTTPConnection, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = ErrorCode.not_found if exc.status_code == 404 else ErrorCode.invalid_request
    return JSONResponse(error_body(exc.detail, code=code), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: HTTPConnection, exc: Exception) -> Response:
    """Starlette logs and re-raises the exception after this answer; the client sees no details."""
    return JSONResponse(error_body("internal error", code=ErrorCode.internal), status_code=500)


__all__ = ["body_cap", "bearer_token", "create_app", "read_capped", "refuse_handshake", "require_credential"]

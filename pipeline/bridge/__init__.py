"""The bridge: an OpenAI-compatible HTTP API and a WebSocket in front of the pipeline, on 127.0.0.1.

    openai_format   OpenAI's JSON to and from sluice's types (pure)
    relay           one request answered over HTTP: SSE or one JSON body, cancelled if the client leaves
    websocket       `/v1/stream`: many requests over one socket
    credentials     the caller's credential as it goes to Kafka: a signed principal token, never the raw key
    app             the Starlette app and its routes

`serve()` runs the app with uvicorn until `stop` is set; `create_app()` gives the app for any ASGI server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from pipeline.bridge.app import MAX_HEADER_BYTES, body_cap, create_app
from pipeline.bridge.edges import head_limited_protocol, websocket_protocol
from pipeline.errors import SluiceError
from pipeline.observability.siblings import Siblings
from pipeline.sdk import Client
from pipeline.settings import Settings

GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish; then they are cancelled (and so are their requests)


class BridgeStartError(SluiceError):
    """The bridge could not start: its address is taken, or the app's startup (the client) failed."""


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its caller, who sets `stop` instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve_until_exit(self, sockets: list[socket.socket] | None = None) -> None:
        """`serve()`, with uvicorn's `sys.exit()` on a failed start turned into `BridgeStartError`."""
        try:
            await self.serve(sockets)
        except SystemExit as exc:
            where = f"{self.config.host}:{self.config.port}"
            raise BridgeStartError(f"the bridge could not start on {where} (uvicorn logged why; exit {exc.code})") from None


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too (SO_REUSEPORT: the kernel
    spreads new connections over them): `sluice run`'s bridge in every process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BridgeStartError(f"the bridge could not start on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


def server_config(settings: Settings, app: Any) -> uvicorn.Config:
    """uvicorn's settings for the bridge. `log_config=None`: uvicorn's own logging config would give its
    loggers a handler of their own that does not propagate, past the root handlers' filters (key
    redaction and the rate limit, pipeline/serve.configure_logging), so a client that makes the bridge log
    a traceback could flood the log and put a key in it; its loggers go to the root handlers instead."""
    tls = settings.gateway.tls
    return uvicorn.Config(
        app,
        log_config=None,
        host=settings.bridge.host,
        port=settings.bridge.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        proxy_headers=False,  # the client address is the TCP peer's; X-Forwarded-For is never trusted
        # a request head slower than header_timeout_s is cut off, one over MAX_HEADER_BYTES refused; a write
        # the client leaves blocked for send_timeout_s ends the connection (so its requests are cancelled)
        http=head_limited_protocol(settings.bridge.header_timeout_s, MAX_HEADER_BYTES, settings.bridge.send_timeout_s),
        ws=websocket_protocol(settings.bridge.send_timeout_s),
        timeout_keep_alive=settings.bridge.keep_alive_s,
        ws_max_size=body_cap(settings.limits),  # a larger message is refused as it arrives, not read whole first
        # TLS, and with a client CA mutual TLS: a client without a certificate the CA signed cannot connect.
        ssl_certfile=tls.certfile or None,
        ssl_keyfile=tls.keyfile or None,
        ssl_ca_certs=tls.client_ca or None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca else ssl.CERT_NONE,
    )


async def serve(
    settings: Settings, client: Client, stop: asyncio.Event, *, owns_client: bool = False, shared_port: bool = False,
    siblings: Siblings | None = None,
) -> None:
    """Serves the bridge on settings.bridge.host:port until `stop` is set; returns once it has shut down.

    With `owns_client` the app starts and stops `client`; otherwise the caller has started it. With
    `shared_port` other processes may serve the same port (`shared_socket`), and `siblings` reaches their
    metrics."""
    app = create_app(settings, client, owns_client=owns_client, siblings=siblings)
    server = _Server(server_config(settings, app))
    sockets = [shared_socket(settings.bridge.host, settings.bridge.port)] if shared_port else None
    serving = asyncio.create_task(server.serve_until_exit(sockets))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        stopping.cancel()
        await asyncio.wait((serving, stopping))
    serving.result()  # re-raises a failure to start or serve


__all__ = ["BridgeStartError", "create_app", "serve"]

"""What a sluice process starts for observability, once: the tracer provider and exporter, a probe of
its dependencies (`sluice_dependency_up`), and, for a `sluice worker` process, a /metrics endpoint of its
own (the bridge serves /metrics on its API port).

A worker's /metrics is prometheus_client's WSGI app, served from a daemon thread as its
`start_http_server` serves it, on `observability.metrics_host` (127.0.0.1 by default, not the bridge's
host: a public bridge does not make every worker's metrics public) and behind `bridge.metrics_token`
when that is set, as the bridge's /metrics is, so one Prometheus scrape config reads both. Settings
refuse a non-loopback `metrics_host` without a token."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pipeline import metrics, tracing
from pipeline.observability.config import bearer_matches
from pipeline.settings import Settings

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 5.0
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def install(settings: Settings, *, serve_metrics: bool = False) -> None:
    tracing.install(settings.observability)
    targets = {"kafka": _address(settings.kafka.bootstrap.split(",")[0], 9092),
               "redis": _address(urlsplit(settings.redis.url).netloc.rsplit("@", 1)[-1], 6379)}
    threading.Thread(target=_probe_loop, args=(targets,), name="sluice-probe", daemon=True).start()
    if serve_metrics:
        metrics_endpoint(settings)


def metrics_endpoint(settings: Settings) -> WSGIServer | None:
    """Serves this process's /metrics on `observability.metrics_host`:`metrics_port` from a daemon thread;
    None when the port is 0 or cannot be bound (logged: the process runs on without it)."""
    host, port, token = settings.observability.metrics_host, settings.observability.metrics_port, settings.bridge.metrics_token
    if not port:
        return None
    app = make_wsgi_app()
    try:
        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = _MetricsServer6 if family == socket.AF_INET6 else _MetricsServer
        server = make_server(address[0], port, _bearer_only(app, token) if token else app, server_class, _Quiet)
    except OSError as exc:  # the port is taken (several workers on one host need SLUICE_METRICS_PORT each)
        log.warning("no /metrics for this process: %s port %d unavailable (%s); set SLUICE_METRICS_PORT per process",
                    host, port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="sluice-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics%s", host, port, " (bearer token required)" if token else "")
    return server


def _bearer_only(app: WsgiApp, token: str) -> WsgiApp:
    """`app` for a bearer of `token` only (the bridge's /metrics check), 401 for anyone else."""
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION", ""), token):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"/metrics needs its bearer token\n"]
    return guarded


class _MetricsServer(ThreadingWSGIServer):  # a thread per scrape, as prometheus_client's own server
    address_family = socket.AF_INET


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line on stderr per scrape."""


def _address(netloc: str, default_port: int) -> tuple[str, int]:
    host, _, port = netloc.rpartition(":")
    return (host or netloc, int(port)) if port.isdigit() else (netloc, default_port)


def probe(address: tuple[str, int], timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to `address` opens (the service listens; not that it is healthy)."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def _probe_loop(targets: dict[str, tuple[str, int]]) -> None:
    stop = threading.Event()  # never set: a daemon thread ends with its process
    while True:
        for name, address in targets.items():
            metrics.DEPENDENCY_UP.labels(name).set(1.0 if probe(address) else 0.0)
        stop.wait(PROBE_INTERVAL_S)

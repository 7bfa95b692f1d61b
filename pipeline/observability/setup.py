"""What a sluice process starts for observability, once: the tracer provider and exporter, a probe of
its dependencies (`sluice_dependency_up`), and, for a `sluice worker` process, a /metrics endpoint of its
own (the bridge serves /metrics on its API port)."""

from __future__ import annotations

import logging
import socket
import threading
from urllib.parse import urlsplit

from prometheus_client import start_http_server

from pipeline import metrics, tracing
from pipeline.settings import Settings

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 5.0


def install(settings: Settings, *, serve_metrics: bool = False) -> None:
    tracing.install(settings.observability)
    targets = {"kafka": _address(settings.kafka.bootstrap.split(",")[0], 9092),
               "redis": _address(urlsplit(settings.redis.url).netloc.rsplit("@", 1)[-1], 6379)}
    threading.Thread(target=_probe_loop, args=(targets,), name="sluice-probe", daemon=True).start()
    port = settings.observability.metrics_port
    if serve_metrics and port:
        try:
            start_http_server(port, addr=settings.bridge.host)
            log.info("metrics on http://%s:%d/metrics", settings.bridge.host, port)
        except OSError as exc:  # the port is taken (several workers on one host need SLUICE_METRICS_PORT each)
            log.warning("no /metrics for this process: port %d unavailable (%s); set SLUICE_METRICS_PORT per process", port, exc)


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

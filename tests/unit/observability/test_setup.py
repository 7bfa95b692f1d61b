"""A `sluice worker`'s own /metrics: on 127.0.0.1 by default whatever the bridge's host, behind the
bridge's metrics token when one is set, and a non-loopback address refused at settings load without one."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import pytest

from pipeline.observability import setup
from pipeline.observability.config import ObservabilitySettings, loopback
from pipeline.settings import BridgeSettings, Settings, SettingsError, load
from tests.ports import free_port

TOKEN = "worker-metrics-token-0123456789"


@contextmanager
def serving(bridge: BridgeSettings, **observability: object) -> Iterator[tuple[WSGIServer, int]]:
    port = free_port()
    server = setup.metrics_endpoint(Settings(bridge=bridge, observability=ObservabilitySettings(metrics_port=port, **observability)))
    assert server is not None
    try:
        yield server, port
    finally:
        server.shutdown()
        server.server_close()


def get(port: int, authorization: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def test_a_worker_serves_metrics_on_loopback_beside_a_public_bridge() -> None:
    with serving(BridgeSettings(host="0.0.0.0")) as (server, port):
        assert server.server_address[0] == "127.0.0.1"  # not the bridge's host
        status, body = get(port)
    assert status == 200 and b"python_info" in body


def test_a_worker_requires_the_bridges_metrics_token_when_one_is_set() -> None:
    with serving(BridgeSettings(metrics_token=TOKEN)) as (_, port):
        assert get(port)[0] == 401
        assert get(port, "Bearer not-the-token")[0] == 401
        assert get(port, TOKEN)[0] == 401  # no scheme
        status, body = get(port, f"bearer {TOKEN}")
    assert status == 200 and b"python_info" in body


def load_text(tmp_path: Path, text: str, env: dict[str, str]) -> Settings:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return load(path, env)


def test_a_non_loopback_metrics_host_needs_the_metrics_token(tmp_path: Path) -> None:
    public = '[observability]\nmetrics_host = "0.0.0.0"\n'
    with pytest.raises(SettingsError, match="'0.0.0.0' is not a loopback address: a worker's /metrics there needs bridge.metrics_token"):
        load_text(tmp_path, public + "metrics_port = 9464\n", {})
    with pytest.raises(SettingsError, match="needs bridge.metrics_token"):  # a port from the environment too
        load_text(tmp_path, public, {"SLUICE_METRICS_PORT": "9464"})
    with_token = load_text(tmp_path, public + "metrics_port = 9464\n", {"SLUICE_METRICS_TOKEN": TOKEN})
    assert with_token.observability.metrics_host == "0.0.0.0"
    assert load_text(tmp_path, public, {}).observability.metrics_port == 0  # no port: nothing served, nothing to refuse
    assert load_text(tmp_path, "", {"SLUICE_METRICS_PORT": "9464"}).observability.metrics_host == "127.0.0.1"


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("metrics.example", False),
])
def test_loopback(host: str, expected: bool) -> None:
    assert loopback(host) is expected

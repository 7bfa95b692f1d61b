"""Real services for integration tests: Kafka and Redis on test ports, every stage in this process
with the real SmolLM2 model. Services already listening on the test ports are reused (and left
running); otherwise they are started fresh from infra/services.sh and stopped at the end."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.backends.base import Backend
from pipeline.bridge import serve
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings
from tests.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
# Two checkouts (or two engineers) testing at once give each run its own ports: SLUICE_TEST_PORTS=K,R
KAFKA_PORT, REDIS_PORT = (int(p) for p in os.environ.get("SLUICE_TEST_PORTS", "29092,26379").split(","))
STATE = ROOT / ".state" / f"test-{KAFKA_PORT}"
GUARDRAILS_BLOCKED = r"\bbananas?\b"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module", autouse=True)
def collect_leaks() -> Iterator[None]:
    """A socket or transport a module's tests left open warns here, in that module, not in a later unit test."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def services() -> Iterator[None]:
    if _listening(KAFKA_PORT) and _listening(REDIS_PORT):
        yield
        return
    # What a run before this one left is stopped by its pid files before they are removed with the rest.
    subprocess.run([ROOT / "infra" / "services.sh", "stop", STATE], check=True)
    shutil.rmtree(STATE, ignore_errors=True)
    try:  # a start that fails after Redis is up is stopped too
        subprocess.run([ROOT / "infra" / "services.sh", "start", STATE, str(KAFKA_PORT), str(REDIS_PORT)], check=True)
        yield
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", STATE], check=True)


@pytest.fixture(scope="session")
def settings(services: None) -> Settings:
    env = {"SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{KAFKA_PORT}", "SLUICE_REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0"}
    settings = settings_module.load(env=env)
    # test_guardrails.py makes the model say this word mid-answer to fire the output guard's kill switch.
    return replace(settings, guard=replace(settings.guard, blocklist=(*settings.guard.blocklist, GUARDRAILS_BLOCKED)))


@pytest.fixture(scope="session")
def backends(settings: Settings) -> dict[str, Backend]:
    return backend_registry.load(settings)


@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def stack(settings: Settings, backends: dict[str, Backend]) -> AsyncIterator[Settings]:
    """Every stage running against the real broker; yields the settings clients should use. Stopped after
    the last integration test: the unit tests after it share the session's event loop, and its consumers
    and their timers should not run under them (nor its teardown be reported against one of them)."""
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    # As `sluice run` wires them: one producer, and guard, cache and route handed their input in memory
    producer = Producer(settings, "sluice-stages-test")
    await producer.start(stop)
    runners = runners_for(assemble.build(assemble.nodes_of(settings), settings, backends), settings, producer, "test")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    ready = asyncio.gather(*(r.ready.wait() for r in runners))
    done, _ = await asyncio.wait([ready, *tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise RuntimeError("stages did not join their consumer groups within 60 s")
    yield settings
    stop.set()
    await asyncio.gather(*tasks)
    await producer.stop()
    for backend in backends.values():
        close = getattr(backend, "aclose", None)
        if close is not None:
            await close()


@dataclass(frozen=True)
class Bridge:
    settings: Settings
    url: str  # http://127.0.0.1:<port>

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/stream"

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def free_kafka_port() -> int:
    """A free port whose next one is free too: Kafka's controller listens on port + 1 (infra/kafka/start.sh)."""
    return free_ports(2)[0]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bridge(stack: Settings) -> AsyncIterator[Bridge]:
    """The bridge served by `serve()` on a free port, on a client the test starts and stops."""
    async with serving_bridge(stack) as served:
        yield served


@contextlib.asynccontextmanager
async def serving_bridge(stack: Settings) -> AsyncIterator[Bridge]:
    """A bridge with `stack`'s settings (on a free port) until the block ends."""
    settings = replace(stack, bridge=replace(stack.bridge, port=free_port()))
    url = f"http://127.0.0.1:{settings.bridge.port}"
    stop = asyncio.Event()
    async with Client(settings, reply_name=settings.bridge.reply_name) as client:
        serving = asyncio.create_task(serve(settings, client, stop))
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(100):
                if serving.done():
                    serving.result()
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the bridge did not start")
        yield Bridge(settings, url)
        stop.set()
        await serving

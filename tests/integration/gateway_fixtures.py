"""Fixtures for the gateway's integration tests.

`secure_bridge` is a second front door on the shared test stack: an ingest stage with
`gateway.auth_required = true` reading its own request topic (`llm.requests.gateway-test`, consumer
group `ingest-gw`), and a bridge whose client produces there. What it admits flows through the stack's
route, prefill, decode and emit like any request, so the session's ingest (auth off) is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from redis.asyncio import Redis

from pipeline import kafka
from pipeline.bridge import serve
from pipeline.gateway.build import redis_client, redis_gateway
from pipeline.gateway.keys import KeyManager
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.runner import Runner
from pipeline.sdk import Client
from pipeline.settings import Settings
from pipeline.stages.ingest import IngestStage
from tests.integration.conftest import KAFKA_PORT
from tests.ports import free_port
from tests.unit.helpers import node
from topics import codec
from topics.requests import Request

ROOT = Path(__file__).resolve().parents[2]
SECURE_REQUESTS = "llm.requests.gateway-test"
CLIENT_SECRET = "test-client-info-secret"


def with_gateway(settings: Settings, **overrides: Any) -> Settings:
    return replace(settings, gateway=replace(settings.gateway, **overrides))


class SecureClient(Client):
    """The SDK client, producing to the secure ingest's topic."""

    requests_topic = SECURE_REQUESTS

    async def _produce(self, request: Request, headers: list[tuple[str, bytes]] | None = None) -> None:
        assert self._producer is not None
        extra = {"headers": headers} if headers else {}  # trace context, where the SDK sends one
        await self._producer.send_and_wait(self.requests_topic, codec.encode(request), key=request.id.encode(), **extra)


@dataclass(frozen=True)
class SecureBridge:
    settings: Settings
    url: str
    keys: KeyManager
    redis: Redis


@pytest_asyncio.fixture(loop_scope="session")
async def redis(settings: Settings) -> AsyncIterator[Redis]:
    client = redis_client(with_gateway(settings, redis_timeout_s=2.0))
    yield client
    await client.aclose()


async def create_topic(settings: Settings, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, client_id="gw-test-admin")
    await admin.start()
    try:
        if name not in await admin.list_topics():
            await admin.create_topics([NewTopic(name, 2, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()


async def wait_healthy(url: str, serving: asyncio.Task[None], **client_options: Any) -> None:
    async with httpx.AsyncClient(base_url=url, **client_options) as http:
        for _ in range(200):
            if serving.done():
                serving.result()
            try:
                if (await http.get("/healthz")).status_code == 200:
                    return
            except httpx.ConnectError:
                await asyncio.sleep(0.05)
    raise RuntimeError("the bridge did not start")


@contextlib.asynccontextmanager
async def front_door(settings: Settings, requests_topic: str, group: str) -> AsyncIterator[SecureBridge]:
    """An ingest stage (consumer group `group`) reading `requests_topic` with `settings`, and a bridge on a
    free port whose client produces there; what it admits flows through the shared stack."""
    settings = replace(settings, bridge=replace(settings.bridge, port=free_port()))
    await create_topic(settings, requests_topic)
    base = node("ingest").topics  # the default graph's ingest, reading this front door's own request topic
    ingest = IngestStage(settings, replace(base, inputs=(requests_topic,)), redis_gateway(settings), name=group)
    stop = asyncio.Event()
    runner = Runner(ingest, settings, instance=group)
    running = asyncio.create_task(runner.run(stop))
    await asyncio.wait([asyncio.create_task(runner.ready.wait()), running], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert runner.ready.is_set(), "the secure ingest did not join its group"
    redis = redis_client(settings)
    url = f"http://127.0.0.1:{settings.bridge.port}"
    client = SecureClient(settings, reply_name=settings.bridge.reply_name)
    client.requests_topic = requests_topic
    async with client:
        serving = asyncio.create_task(serve(settings, client, stop))
        await wait_healthy(url, serving)
        yield SecureBridge(settings, url, KeyManager(RedisKeyStore(redis), rotate_overlap_s=3600), redis)
        stop.set()
        await serving
    await running  # the runner closes the stage's Redis client
    await redis.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secure_bridge(stack: Settings) -> AsyncIterator[SecureBridge]:
    settings = with_gateway(stack, auth_required=True, key_cache_s=0.0, client_info_secret=CLIENT_SECRET)
    async with front_door(settings, SECURE_REQUESTS, "ingest-gw") as door:
        yield door


async def restart_redis(port: int, down_s: float) -> None:
    """Shuts Redis down (its append-only file is flushed), waits `down_s`, starts it again from its dir."""
    probe = Redis(port=port)
    directory = (await probe.config_get("dir"))["dir"]
    assert (await probe.config_get("appendonly"))["appendonly"] == "yes", "Redis must persist key records"
    await probe.aclose()
    stop = await asyncio.create_subprocess_exec("redis-cli", "-p", str(port), "shutdown", stdout=asyncio.subprocess.DEVNULL)
    await stop.wait()
    await asyncio.sleep(down_s)
    start = await asyncio.create_subprocess_exec(str(ROOT / "infra" / "redis" / "start.sh"), directory, str(port))
    assert await start.wait() == 0


async def pipeline_topics(settings: Settings) -> tuple[str, ...]:
    """Every sluice topic except the request topics (where a client's credential legitimately is)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, client_id="gw-test-admin")
    await admin.start()
    try:
        names = await admin.list_topics()
    finally:
        await admin.close()
    return tuple(sorted(n for n in names if n.startswith("llm.") and not n.startswith("llm.requests")))


async def topic_reader(settings: Settings, topics: tuple[str, ...]) -> tuple[Any, list[tuple[str, bytes]]]:
    """A consumer on `topics` from now on, and the list a task fills with every (topic, key|value) it reads."""
    consumer = await kafka.broadcast_consumer(settings, topics, "gw-test-reader-" + str(free_port()))
    seen: list[tuple[str, bytes]] = []

    async def read() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            for records in batch.values():
                seen.extend((r.topic, (r.key or b"") + b"|" + (r.value or b"")) for r in records)

    task = asyncio.create_task(read())
    return (consumer, task), seen


@dataclass(frozen=True)
class SecureBroker:
    bootstrap: str
    admin_password: str
    admin_password_file: Path

    def client_options(self, user: str, password: str) -> dict[str, str]:
        return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                "sasl_plain_username": user, "sasl_plain_password": password}

    def add_tenant(self, tenant: str, password: str) -> None:
        java = ["java", "-cp", str(ROOT / "infra" / "kafka" / "lib" / "*"),
                "-Dlog4j2.configurationFile=" + str(ROOT / "infra" / "kafka" / "log4j2.yaml"),
                str(ROOT / "infra" / "kafka" / "TenantAcls.java"), self.bootstrap, str(self.admin_password_file), tenant]
        assert not any(self.admin_password in arg or password in arg for arg in java)  # no secret on a command line
        subprocess.run(java, check=True, capture_output=True, timeout=120, input=password.encode() + b"\n")


@pytest.fixture(scope="module")
def secure_broker() -> Iterator[SecureBroker]:
    """A second broker in the secure profile (SASL/SCRAM, ACLs) on the test Kafka port + 100."""
    port = KAFKA_PORT + 100
    state = ROOT / ".state" / f"test-secure-{port}"
    shutil.rmtree(state, ignore_errors=True)
    subprocess.run([ROOT / "infra" / "kafka" / "start.sh", state, str(port), "--secure"], check=True)
    try:
        yield SecureBroker(f"127.0.0.1:{port}", (state / "kafka-admin.password").read_text().strip(), state / "kafka-admin.password")
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)

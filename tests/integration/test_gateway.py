"""The gateway against the real Redis and Kafka: limit accuracy with four ingest workers (also while
Redis restarts), keys through the bridge, 429 headers, attacks, and no raw key anywhere it must not be."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid

import httpx
import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from redis.asyncio import Redis

from pipeline.errors import StageError
from pipeline.gateway.build import redis_client, redis_gateway
from pipeline.gateway.keys import PREFIX, KeyManager, hash_key
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.metrics import GATEWAY_DEGRADED
from pipeline.settings import Settings
from pipeline.stages.ingest import IngestStage
from tests.integration.conftest import REDIS_PORT, ROOT
from tests.integration.gateway_fixtures import (
    SECURE_REQUESTS,
    SecureBridge,
    pipeline_topics,
    redis,
    restart_redis,
    secure_bridge,
    topic_reader,
    with_gateway,
)
from tests.unit.fakes import run_handler
from tests.unit.helpers import node
from topics import registry
from topics.requests import ChatMessage, Request, Sampling

__all__ = ["redis", "secure_bridge"]  # fixtures
pytestmark = pytest.mark.asyncio(loop_scope="session")
HELLO = [{"role": "user", "content": "Say hi."}]


def attempt(settings: Settings, key: str, n: int) -> Request:
    return Request(
        id=f"acc-{uuid.uuid4().hex[:12]}-{n}", reply_to="llm.responses.sdk", model=settings.models[0],
        created_at=time.time(), messages=(ChatMessage(role="user", content="hello"),), sampling=Sampling(max_tokens=4),
        api_key=key,
    )


async def accuracy_run(settings: Settings, *, restart: bool) -> dict[str, int]:
    """Four ingest workers (each its own Redis connections) make 1,000 attempts for one key at 100 rpm."""
    admin = redis_client(settings)
    key, _ = await KeyManager(RedisKeyStore(admin), rotate_overlap_s=60).create("acc-" + uuid.uuid4().hex[:6], rpm=100)
    await admin.aclose()
    workers = [IngestStage(settings, node("ingest").topics, redis_gateway(settings)) for _ in range(4)]
    outcomes: dict[str, int] = {}

    async def worker(w: int) -> None:
        for i in range(250):
            try:
                await run_handler(workers[w], attempt(settings, key, w * 1000 + i))
                outcome = "admitted"
            except StageError as exc:
                outcome = exc.code.value
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            await asyncio.sleep(0.008)

    tasks = [asyncio.create_task(worker(w)) for w in range(4)]
    if restart:
        await asyncio.sleep(0.6)
        await restart_redis(REDIS_PORT, down_s=0.7)
    await asyncio.gather(*tasks)
    for stage in workers:
        await stage.aclose()
    print(f"accuracy (restart={restart}, on_redis_down={settings.gateway.on_redis_down}): {outcomes}")
    return outcomes


async def no_rate_limit_key_without_ttl(redis: Redis) -> None:
    keys = [k async for k in redis.scan_iter(match="sluice:rl:*", count=1000)]
    assert keys
    ttls = [await redis.pttl(k) for k in keys]
    assert all(t > 0 for t in ttls), [k for k, t in zip(keys, ttls, strict=True) if t <= 0]


async def test_four_ingest_workers_admit_at_most_the_limit(settings: Settings, redis: Redis) -> None:
    started = time.monotonic()
    outcomes = await accuracy_run(settings, restart=False)
    assert time.monotonic() - started < 60  # so every attempt fell within one window
    assert sum(outcomes.values()) == 1000
    assert 95 <= outcomes["admitted"] <= 101, outcomes
    assert outcomes["admitted"] + outcomes["rate_limited"] == 1000
    await no_rate_limit_key_without_ttl(redis)


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_limits_hold_while_redis_restarts(settings: Settings, redis: Redis, mode: str) -> None:
    configured = with_gateway(settings, on_redis_down=mode)
    before = GATEWAY_DEGRADED.labels("limit", mode)._value.get()
    outcomes = await accuracy_run(configured, restart=True)
    degraded = GATEWAY_DEGRADED.labels("limit", mode)._value.get() - before
    assert sum(outcomes.values()) == 1000
    assert degraded > 0, outcomes  # the restart was seen, and every decision taken without Redis is counted
    if mode == "closed":
        assert outcomes["admitted"] <= 101 and outcomes.get("unavailable", 0) == degraded, (outcomes, degraded)
    else:
        assert outcomes["admitted"] - degraded <= 101 and "unavailable" not in outcomes, (outcomes, degraded)
    await no_rate_limit_key_without_ttl(redis)


def chat(key: str | None, **extra: object) -> dict[str, object]:
    return {"model": "smollm2-135m-instruct", "messages": HELLO, "max_tokens": 2, **extra}


async def post(bridge: SecureBridge, body: dict[str, object], key: str | None, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        return await http.post("/v1/chat/completions", json=body, headers=headers)


async def test_a_created_key_gets_an_answer_and_its_usage_is_charged(secure_bridge: SecureBridge) -> None:
    key, record = await secure_bridge.keys.create("acme", tpm=100_000, budget=100.0)  # spend is kept against a budget
    response = await post(secure_bridge, chat(key), key)
    assert response.status_code == 200, response.text
    for _ in range(100):  # emit charges right after it sends the terminal event
        log = [m.decode() async for m, _ in secure_bridge.redis.zscan_iter(f"sluice:rl:{{key:{record.key_id}}}:tok")]
        if any(":c|" in m for m in log):
            break
        await asyncio.sleep(0.1)
    assert any(":c|" in m for m in log) and not any(":p|" in m for m in log), log  # the reservation was replaced
    spent = await secure_bridge.redis.get("sluice:spend:{key:" + record.key_id + "}")
    assert spent is not None and float(spent) > 0  # priced in sluice.toml


async def test_rate_limited_requests_get_429_with_retry_after_and_ratelimit_headers(secure_bridge: SecureBridge) -> None:
    key, _ = await secure_bridge.keys.create("acme", rpm=1)
    assert (await post(secure_bridge, chat(key), key)).status_code == 200
    refused = await post(secure_bridge, chat(key), key)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "1" and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-scope"] == "key" and refused.headers["x-ratelimit-reset-requests"].endswith("s")


@pytest.mark.parametrize(
    "credential",
    ["' OR '1'='1", PREFIX + "A" * 43, PREFIX + "' OR '1'='1", "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.", None, "unused"],
)
async def test_bad_credentials_are_401(secure_bridge: SecureBridge, credential: str | None) -> None:
    response = await post(secure_bridge, chat(credential), credential)
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"


async def test_revoked_and_rotated_out_keys_are_401(secure_bridge: SecureBridge) -> None:
    revoked, record = await secure_bridge.keys.create("acme")
    await secure_bridge.keys.revoke(record.key_id)
    expired, record2 = await secure_bridge.keys.create("acme")
    fresh, _ = await secure_bridge.keys.rotate(record2.key_id, overlap_s=0.5)
    await asyncio.sleep(0.6)
    assert (await post(secure_bridge, chat(revoked), revoked)).status_code == 401
    assert (await post(secure_bridge, chat(expired), expired)).status_code == 401
    assert (await post(secure_bridge, chat(fresh), fresh)).status_code == 200


async def test_oversized_headers_are_refused_before_the_app(secure_bridge: SecureBridge) -> None:
    key, _ = await secure_bridge.keys.create("acme")
    async with httpx.AsyncClient(base_url=secure_bridge.url, timeout=30) as http:
        try:
            response = await http.post("/v1/chat/completions", json=chat(key),
                                       headers={"authorization": f"Bearer {key}", "x-pad": "a" * 70_000})
            assert response.status_code == 431
        except httpx.RemoteProtocolError:
            pass  # the server closed the connection: refused too
        huge = await http.post("/v1/chat/completions", json=chat(None), headers={"authorization": "Bearer " + PREFIX + "a" * 8000})
        assert huge.status_code in (401, 431, 400)


@pytest.mark.parametrize("path", ["/admin", "/v1/keys", "/admin/keys", "/internal/config", "/../admin"])
async def test_a_host_header_aimed_at_admin_routes_finds_nothing(secure_bridge: SecureBridge, path: str) -> None:
    async with httpx.AsyncClient(base_url=secure_bridge.url, timeout=30) as http:
        for method in ("GET", "POST", "DELETE"):
            response = await http.request(method, path, headers={"host": "admin.internal", "x-forwarded-host": "localhost"})
            assert response.status_code in (400, 404, 405), (method, path, response.status_code)  # 400: the Host


async def test_a_body_naming_a_backend_url_is_ignored(secure_bridge: SecureBridge) -> None:
    key, _ = await secure_bridge.keys.create("acme")
    body = chat(key, backend="http://127.0.0.1:1/steal", base_url="http://169.254.169.254/", api_base="http://evil")
    response = await post(secure_bridge, body, key)
    assert response.status_code == 200  # answered by the configured backend; the fields are not read
    smuggled = {**msgspec.to_builtins(attempt(secure_bridge.settings, key, 0)), "backend_url": "http://evil"}
    with pytest.raises(msgspec.ValidationError):  # and a Kafka producer cannot add one to the schema
        msgspec.convert(smuggled, Request)


async def test_the_raw_key_appears_in_no_log_span_metric_dead_letter_or_topic(
    secure_bridge: SecureBridge, caplog: pytest.LogCaptureFixture
) -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    topics = await pipeline_topics(secure_bridge.settings)
    assert {registry.DLQ, registry.ADMITTED, registry.TOKENS, registry.USAGE, "llm.responses.bridge"} <= set(topics)
    (consumer, reader), seen = await topic_reader(secure_bridge.settings, topics)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.WARNING, logger="aiokafka")  # as serve.configure_logging pins it: its DEBUG logs payloads
    key, record = await secure_bridge.keys.create("acme")
    try:
        assert (await post(secure_bridge, chat(key), key)).status_code == 200
        await secure_bridge.keys.revoke(record.key_id)
        assert (await post(secure_bridge, chat(key), key)).status_code == 401
        # a malformed request carrying the key goes to the dead-letter topic
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=secure_bridge.settings.kafka.bootstrap)
        await producer.start()
        bad = msgspec.json.encode({"kind": "request.v1", "id": "dlq-" + uuid.uuid4().hex[:8], "reply_to": "llm.responses.bridge",
                                   "model": "x", "created_at": time.time(), "api_key": key, "surprise": 1})
        await producer.send_and_wait(SECURE_REQUESTS, bad, key=b"dlq")
        await producer.stop()
        await asyncio.sleep(2.0)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await consumer.stop()
    secret_body = key[len(PREFIX) :]
    assert any(topic == registry.DLQ for topic, _ in seen), "the malformed request should have been dead-lettered"
    assert any(topic == registry.ADMITTED for topic, _ in seen) and any(topic == registry.USAGE for topic, _ in seen)
    assert [topic for topic, value in seen if secret_body.encode() in value] == []
    assert secret_body not in caplog.text
    assert secret_body.encode() not in generate_latest()
    for span in spans.get_finished_spans():
        assert secret_body not in span.name and all(secret_body not in str(v) for v in (span.attributes or {}).values())
    assert hash_key(key) != key


async def test_the_keys_command_creates_lists_and_revokes(settings: Settings, redis: Redis) -> None:
    env = {"SLUICE_REDIS_URL": settings.redis.url, "PATH": "/usr/bin:/bin"}
    sluice = [sys.executable, "-m", "pipeline.cli", "keys"]

    def run(*args: str) -> str:
        done = subprocess.run([*sluice, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    created = run("create", "--tenant", "cli-test", "--models", "smollm2-135m-instruct", "--rpm", "5", "--budget", "2.5")
    raw = next(line.split(": ", 1)[1] for line in created.splitlines() if line.startswith("api key"))
    key_id = next(line.split(": ", 1)[1] for line in created.splitlines() if line.startswith("key_id"))
    assert raw.startswith(PREFIX) and await redis.get("sluice:key:{" + hash_key(raw) + "}") is not None
    listed = run("list")
    assert key_id in listed and raw not in listed and raw[len(PREFIX) :] not in listed
    rotated = run("rotate", key_id, "--overlap-s", "0")
    assert raw not in rotated and PREFIX in rotated
    run("revoke", key_id)
    assert "revoked" in run("list").split(key_id, 1)[1].splitlines()[0]
    async for k in redis.scan_iter(match="sluice:*"):
        assert raw[len(PREFIX) :].encode() not in (await redis.dump(k) or b"")

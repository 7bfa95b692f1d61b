"""No raw credential persists in Kafka (issue 14, item 3): after requests through the bridge (HTTP and
WebSocket) and from the SDK straight to Kafka with a real key, no record of any topic and no file of the
broker's log directory holds the key; what reached `llm.requests` is the key's hash, under the bridge's
HMAC or the SDK's signature with the key's own pair. The broker's files are private to its user."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets
from aiokafka.admin import AIOKafkaAdminClient

from pipeline import kafka
from pipeline.gateway.keys import PREFIX, hash_key
from pipeline.settings import Settings
from tests.integration.conftest import STATE
from tests.integration.gateway_fixtures import SECURE_REQUESTS, SecureBridge, SecureClient, secure_bridge
from topics import codec
from topics.requests import Request

__all__ = ["secure_bridge"]  # fixtures
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def through_the_bridge(bridge: SecureBridge, key: str) -> None:
    body = {"model": bridge.settings.models[0], "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        completion = {"model": body["model"], "prompt": "Hello", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=completion, headers=headers)).status_code == 200
    async with websockets.connect(bridge.url.replace("http://", "ws://") + "/v1/stream", additional_headers=headers) as ws:
        await ws.send(json.dumps(body))
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        while event["type"] not in ("done", "error"):
            event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        assert event["type"] == "done", event


async def from_the_sdk(bridge: SecureBridge, key: str) -> None:
    """A direct Kafka producer: the SDK client, with the key, producing to the secure ingest's topic."""
    async with SecureClient(bridge.settings, reply_name="sdk") as client:
        answer = await client.complete(messages=[{"role": "user", "content": "Say hi."}], max_tokens=2, api_key=key)
        assert answer.done.chunks >= 1
        chat = [{"role": "user", "content": "Say ok."}]
        async for _ in client.stream(messages=chat, max_tokens=2, api_key=key):
            pass


async def every_record(settings: Settings) -> dict[str, list[bytes]]:
    """Every record (key and value) of every topic, internal ones included, from the start of each partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, client_id="raw-key-admin")
    await admin.start()
    try:
        topics = tuple(sorted(await admin.list_topics()))
    finally:
        await admin.close()
    consumer = await kafka.broadcast_consumer(settings, topics, "raw-key-reader", from_start=True)
    records: dict[str, list[bytes]] = {t: [] for t in topics}
    try:
        ends = await consumer.end_offsets(list(consumer.assignment()))
        deadline = time.monotonic() + 60
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            assert time.monotonic() < deadline, "could not read every topic to its end in 60 s"
            for tp, batch in (await consumer.getmany(timeout_ms=200, max_records=5000)).items():
                records[tp.topic].extend((r.key or b"") + b"|" + (r.value or b"") for r in batch)
    finally:
        await consumer.stop()
    return records


async def test_no_raw_key_in_any_topic_or_segment_file(secure_bridge: SecureBridge) -> None:
    key, record = await secure_bridge.keys.create("acme")
    await through_the_bridge(secure_bridge, key)
    await from_the_sdk(secure_bridge, key)
    secret = key[len(PREFIX) :].encode()  # the key's random part: what makes it a credential

    records = await every_record(secure_bridge.settings)
    assert {SECURE_REQUESTS, "llm.admitted", "llm.tokens", "llm.usage", "llm.dlq"} <= set(records)
    assert len(records[SECURE_REQUESTS]) >= 5 and records["llm.admitted"], "the reader saw too little: the search below would prove nothing"
    assert [topic for topic, values in records.items() if any(secret in v for v in values)] == []
    sent = [codec.decode(v.split(b"|", 1)[1], Request) for v in records[SECURE_REQUESTS] if hash_key(key).encode() in v]
    kinds = sorted(r.principal_token.kind for r in sent if r.principal_token is not None)
    seen = f"{len(records[SECURE_REQUESTS])} records on {SECURE_REQUESTS}, {len(sent)} with the key's hash"
    assert kinds == ["key"] * 3 + ["signed_key"] * 2, "the bridge's three and the SDK's two requests, under the key's hash; " + seen
    assert all(r.api_key is None for r in sent)
    assert sum(record.key_id.encode() in v for v in records["llm.admitted"]) == 5  # ingest admitted them as that key

    log_dir = STATE / "kafka-data"
    files = [f for f in log_dir.rglob("*") if f.is_file()]
    request_segments = [f for f in files if f.parent.name.startswith(SECURE_REQUESTS + "-") and f.suffix == ".log"]
    assert request_segments, f"no segment of {SECURE_REQUESTS} under {log_dir}"
    assert any(hash_key(key).encode() in f.read_bytes() for f in request_segments)  # the grep sees what was written
    assert [str(f) for f in files if secret in contents(f)] == []


def contents(path) -> bytes:
    """A file's bytes; the broker renames its checkpoint `.tmp` files while we walk, so one may be gone."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


async def test_the_brokers_directories_and_files_are_private(secure_bridge: SecureBridge) -> None:
    """Segments hold every prompt and answer: infra/kafka/start.sh runs the broker under umask 077."""
    log_dir = STATE / "kafka-data"
    assert any(p.suffix == ".log" for p in log_dir.rglob("*")), "no segment written yet"
    assert log_dir.stat().st_mode & 0o777 == 0o700
    shared = []
    for path in [log_dir, *log_dir.rglob("*")]:
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:  # a segment deleted by retention meanwhile
            continue
        if mode & 0o077:
            shared.append(f"{path} {mode:o}")
    assert shared == []

"""The Batch API against a real stack: its own Kafka and Redis, ingest (keys required, the gateway
secret set) -> route -> prefill -> decode -> emit on the instant backend, and the bridge with its job
worker. The official `openai` client with only base_url changed: files.create, batches.create,
retrieve, list, cancel, files.content; tenant isolation with two real keys; the direct mode."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.batch.config import BatchSettings
from pipeline.batch.direct import DirectJob
from pipeline.batch.records import Status
from pipeline.batch.worker import POLL_S
from pipeline.bridge import serve
from pipeline.gateway.build import redis_client
from pipeline.gateway.keys import KeyManager
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.runner import Runner
from pipeline.sdk import Client
from pipeline.settings import BackendSettings, Settings
from tests.integration.conftest import ROOT, free_kafka_port
from tests.ports import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "instant"
CHAT = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class Stack:
    settings: Settings
    url: str
    keys: dict[str, str]  # tenant -> raw key

    def openai(self, tenant: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.keys[tenant], max_retries=0, timeout=60)


def jsonl(n: int, *, max_tokens: int = 4, prefix: str = "req") -> bytes:
    rows = [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": CHAT,
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens}}
            for i in range(n)]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture(scope="module")
def own_services() -> Iterator[Settings]:
    """Kafka and Redis of this module's own: its stages share the session stack's consumer group names."""
    kafka_port, redis_port = free_kafka_port(), free_port()
    state = ROOT / ".state" / f"test-batch-{kafka_port}"
    shutil.rmtree(state, ignore_errors=True)
    subprocess.run([ROOT / "infra" / "services.sh", "start", state, str(kafka_port), str(redis_port)], check=True)
    try:
        yield settings_module.load(env={"SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka_port}",
                                        "SLUICE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)
        shutil.rmtree(state, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(own_services: Settings, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    base = own_services
    settings = dataclasses.replace(
        base, backends=(BackendSettings(name="instant", kind="instant", model=MODEL, pool="instant", token_delay_ms=2.0),),
        profile="batchtest", profiles={**base.profiles, "batchtest": ("ingest", "route", "prefill", "decode", "emit")},
        cache=dataclasses.replace(base.cache, enabled=False),
        gateway=dataclasses.replace(base.gateway, auth_required=True, client_info_secret="batch-test-secret"),
        batch=dataclasses.replace(base.batch, dir=str(tmp_path_factory.mktemp("batch")), lease_s=2.0),
        bridge=dataclasses.replace(base.bridge, port=free_port()),
    )
    await kafka.create_topics(settings)
    redis = redis_client(settings)
    manager = KeyManager(RedisKeyStore(redis), rotate_overlap_s=0)
    keys = {tenant: (await manager.create(tenant))[0] for tenant in ("acme", "globex")}
    await redis.aclose()
    stop = asyncio.Event()
    stages = assemble.build(assemble.nodes_of(settings), settings, backend_registry.load(settings), worker="batch-test")
    runners = [Runner(s, settings, instance="batch-test") for s in stages]
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.wait_for(asyncio.gather(*(r.ready.wait() for r in runners)), 60)
    url = f"http://127.0.0.1:{settings.bridge.port}"
    async with Client(settings, reply_name=settings.bridge.reply_name) as client:
        serving = asyncio.create_task(serve(settings, client, stop))
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(200):
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
        yield Stack(settings, url, keys)
        stop.set()
        await serving
    await asyncio.gather(*tasks)


async def wait_for(client: openai.AsyncOpenAI, batch_id: str, statuses: set[str], timeout_s: float = 120) -> Any:
    for _ in range(int(timeout_s / 0.2)):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        await asyncio.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} ({batch.request_counts})")


async def test_the_official_client_runs_a_batch_through_the_pipeline(stack: Stack) -> None:
    async with stack.openai("acme") as client:
        bad = [b'{"custom_id": "broken"', json.dumps({"custom_id": "req-3", "url": CHAT, "body": {"model": MODEL,
               "messages": [{"role": "user", "content": "again"}]}}).encode(),
               json.dumps({"custom_id": "unknown-model", "url": CHAT, "body": {"model": "gpt-17",
               "messages": [{"role": "user", "content": "x"}]}}).encode()]
        data = jsonl(40) + b"\n".join(bad) + b"\n"
        uploaded = await client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        done = await wait_for(client, batch.id, {"completed"})
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (43, 40, 3)
        assert done.output_file_id and done.error_file_id and done.errors is None
        out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
        listed = [b.id async for b in client.batches.list(limit=10)]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(40)]
    body = out[7]["response"]["body"]
    assert out[7]["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "t0 t1 t2 t3 " and body["usage"]["completion_tokens"] == 4
    assert [(e["custom_id"], e["error"]["line"] if e["error"] else None) for e in errors] == [
        (None, 41), ("req-3", 42), ("unknown-model", None)]
    assert errors[1]["error"]["code"] == "duplicate_custom_id"
    assert errors[2]["response"]["status_code"] == 404  # ingest's answer: the model is not configured
    assert batch.id in listed


async def test_another_tenant_cannot_see_or_touch_a_batch_or_its_files(stack: Stack) -> None:
    async with stack.openai("acme") as acme, stack.openai("globex") as globex:
        uploaded = await acme.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
        batch = await acme.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        done = await wait_for(acme, batch.id, {"completed"})
        for attempt in (globex.files.retrieve(uploaded.id), globex.files.content(done.output_file_id),
                        globex.batches.retrieve(batch.id), globex.batches.cancel(batch.id),
                        globex.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await attempt
        assert batch.id not in [b.id async for b in globex.batches.list()]
        assert (await acme.files.content(done.output_file_id)).text.count("\n") == 3
        assert {uploaded.id, done.output_file_id} <= {f.id async for f in acme.files.list()}
        assert {f.id async for f in acme.files.list(purpose="batch")} >= {uploaded.id}
        assert not {uploaded.id, done.output_file_id} & {f.id async for f in globex.files.list()}


# Slack on the lines a cancel may still let finish: the worker's watcher reads the job's status every
# POLL_S, and this long more covers the cancel's HTTP round trip and the watcher's Redis read, on one event
# loop shared with the stages, the bridge and the client on a loaded 2-core host.
CANCEL_NOTICED_SLACK_S = 3.0


def finished_after_cancel_at_most(batch: BatchSettings) -> int:
    """Lines that may still finish once the cancel is sent: those in flight (at most `max_in_flight`), and
    those started before the worker's watcher sees it (at most POLL_S + slack at `admission_rps` a second,
    and one more: the pacing lets the first start go at once). 12 + 201 with the defaults, of 400."""
    assert batch.admission_rps > 0, "the bound needs a start rate"
    started_meanwhile = int(batch.admission_rps * (POLL_S + CANCEL_NOTICED_SLACK_S)) + 1
    return batch.max_in_flight + started_meanwhile


async def test_cancel_mid_job_stops_it_and_keeps_what_finished(stack: Stack) -> None:
    async with stack.openai("acme") as client:
        uploaded = await client.files.create(file=("in.jsonl", jsonl(400, max_tokens=100)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        running = await wait_for(client, batch.id, {"in_progress"})
        while (running.request_counts.completed if running.request_counts else 0) < 5:
            running = await client.batches.retrieve(batch.id)
            await asyncio.sleep(0.1)
        assert running.request_counts is not None
        at_cancel = running.request_counts.completed  # read just before the cancel
        await client.batches.cancel(batch.id)
        done = await wait_for(client, batch.id, {"cancelled"})
        assert done.request_counts is not None and done.request_counts.total == 400
        finished = done.request_counts.completed
        bound = at_cancel + finished_after_cancel_at_most(stack.settings.batch)
        assert at_cancel <= finished <= bound, f"{finished} finished, {at_cancel} when the cancel was sent, at most {bound}"
        assert done.request_counts.failed == 400 - finished
        errors = (await client.files.content(done.error_file_id)).text.splitlines()
        out = (await client.files.content(done.output_file_id)).text.splitlines()
    assert len(errors) == 400 - finished and len(out) == finished
    assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len({json.loads(x)["custom_id"] for x in errors + out}) == 400


async def test_direct_mode_runs_a_file_over_kafka_and_a_second_run_resumes_nothing(stack: Stack, tmp_path: Path) -> None:
    data = jsonl(25, prefix="direct")
    job = DirectJob(stack.settings, stack.keys["globex"])
    await job.start()
    try:
        batch = await job.prepare(io.BytesIO(data), "in.jsonl", "digest-of-this-test", CHAT)
        batch = await job.run(batch)
        job.copy_results(batch, tmp_path / "out.jsonl", tmp_path / "err.jsonl")
        again = await job.prepare(io.BytesIO(data), "in.jsonl", "digest-of-this-test", CHAT)
    finally:
        await job.stop()
    assert batch.status is Status.completed and batch.tenant == "globex" and again.id == batch.id
    assert again.status is Status.completed  # the same command again finds the finished job
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"direct-{i}" for i in range(25)]
    assert (tmp_path / "err.jsonl").read_bytes() == b""


async def test_the_cli_submits_waits_and_writes_the_results(stack: Stack, tmp_path: Path) -> None:
    import argparse

    from pipeline.batch import cli as batch_cli

    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(12, prefix="cli") + b"not json\n")
    common = {"base_url": stack.url + "/v1", "api_key": stack.keys["acme"]}
    submit = argparse.Namespace(action="submit", input=source, endpoint=CHAT, wait=True, output=tmp_path / "out.jsonl",
                                errors=tmp_path / "err.jsonl", **common)
    assert await batch_cli.run(stack.settings, submit) == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    err = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"cli-{i}" for i in range(12)]
    assert [e["error"]["line"] for e in err] == [13]
    unknown = argparse.Namespace(action="status", batch_id="batch_" + "0" * 24, **common)
    assert await batch_cli.run(stack.settings, unknown) == 1  # 404, said on stderr


async def test_a_job_whose_every_line_fails_says_so(stack: Stack, tmp_path: Path) -> None:
    rows = [{"custom_id": f"x{i}", "method": "POST", "url": CHAT,
             "body": {"model": "gpt-17", "messages": [{"role": "user", "content": "q"}]}} for i in range(3)]
    async with stack.openai("acme") as client:
        uploaded = await client.files.create(file=("in.jsonl", "\n".join(json.dumps(r) for r in rows).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        done = await wait_for(client, batch.id, {"completed"})
    assert done.output_file_id is None and done.error_file_id
    assert done.request_counts is not None and done.request_counts.failed == done.request_counts.total == 3
    assert done.errors is not None and done.errors.data[0].code == "all_requests_failed"

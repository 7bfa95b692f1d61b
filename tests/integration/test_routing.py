"""Routing against real servers: three OpenAI-compatible upstreams behind three pools (bench.fake_openai
over HTTP), the stages on the real broker. One upstream answers 500, one stalls past the backend's
timeout: every request still succeeds (moved on before its first token), and the failing one is ejected
after its 5th consecutive failure, so the requests after that no longer reach it."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from bench.fake_openai import FakeUpstream
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.runner import Runner
from pipeline.sdk import Client, RequestFailed
from pipeline.settings import BackendSettings, Settings
from tests.integration.conftest import ROOT, free_kafka_port
from tests.ports import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "fake-model"


@pytest.fixture(scope="module")
def own_services() -> Iterator[Settings]:
    """Kafka and Redis of this module's own: its stages are named like the session stack's (route, emit...),
    and two deployments with the same consumer groups on one broker would share their partitions."""
    kafka_port, redis_port = free_kafka_port(), free_port()
    state = ROOT / ".state" / f"test-routing-{kafka_port}"
    shutil.rmtree(state, ignore_errors=True)
    subprocess.run([ROOT / "infra" / "services.sh", "start", state, str(kafka_port), str(redis_port)], check=True)
    try:
        yield settings_module.load(env={"SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka_port}",
                                        "SLUICE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def upstreams(own_services: Settings) -> AsyncIterator[tuple[Settings, list[FakeUpstream]]]:
    settings = own_services
    fakes = [FakeUpstream(free_port()) for _ in range(3)]
    for fake in fakes:
        await fake.__aenter__()
    backends = tuple(
        BackendSettings(name=f"up{i}", model=MODEL, pool=f"up{i}", kind="openai", base_url=fake.base_url, timeout_s=1.5, max_batch=8)
        for i, fake in enumerate(fakes)
    )
    routed = dataclasses.replace(
        settings, backends=backends, profile="routing",
        profiles={**settings.profiles, "routing": ("ingest", "route", "prefill", "decode", "emit")},
        cache=dataclasses.replace(settings.cache, enabled=False),
    )
    await kafka.create_topics(routed)
    stop = asyncio.Event()
    loaded = backend_registry.load(routed)
    stages = assemble.build(assemble.nodes_of(routed), routed, loaded, worker="routing-test")
    runners = [Runner(s, routed, instance="routing-test") for s in stages]
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.wait_for(asyncio.gather(*(r.ready.wait() for r in runners)), 60)
    yield routed, fakes
    stop.set()
    await asyncio.gather(*tasks)
    for backend in loaded.values():  # their HTTP connections to the upstreams
        close = getattr(backend, "aclose", None)
        if close is not None:
            await close()
    for fake in fakes:
        await fake.__aexit__()


async def test_every_request_succeeds_while_one_upstream_fails_and_one_stalls(upstreams) -> None:  # type: ignore[no-untyped-def]
    settings, (healthy, failing, stalling) = upstreams
    failing.state.mode = "fail"
    stalling.state.mode, stalling.state.stall_s = "stall", 3.0
    async with Client(settings, model=MODEL) as client:
        async def one(i: int) -> str:
            try:
                answer = await client.complete(messages=[{"role": "user", "content": f"question {i}"}], max_tokens=6)
                return answer.text
            except RequestFailed as exc:
                return f"failed: {exc.code.value}"

        first = await asyncio.gather(*(one(i) for i in range(30)))
        refused_before = failing.state.refused
        await asyncio.sleep(0.5)
        second = await asyncio.gather(*(one(100 + i) for i in range(30)))
    answers = first + second
    assert all(a == "w0 w1 w2 w3 w4 w5 " for a in answers), [a for a in answers if not a.startswith("w0")][:3]
    assert refused_before >= 5  # the failing member was tried and failed ...
    assert failing.state.refused - refused_before <= 5 + 1  # ... then ejected: at most threshold + route processes more
    assert healthy.state.served >= 40

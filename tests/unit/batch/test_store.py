"""What bounds the job store: every job's state expires, even a job that never ends, and a tenant may have
only so many unfinished jobs. On the in-memory store always; on the Redis store (its Lua scripts) where
fakeredis with Lua is installed (`fakeredis[lua]`), else tests/integration/test_batch_stores.py covers it
against a real Redis."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from pipeline.batch.records import Batch, Recorded, Status, new_batch_id
from pipeline.batch.store import JobStore, MemoryJobStore

pytestmark = pytest.mark.asyncio
KEEP_S = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def fake_redis() -> Any:
    fakeredis = pytest.importorskip("fakeredis")
    pytest.importorskip("lupa")
    return fakeredis.FakeAsyncRedis()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[JobStore]:
    if request.param == "memory":
        backing: JobStore = MemoryJobStore(keep_s=KEEP_S)
    else:
        from pipeline.batch.redis_store import RedisJobStore

        backing = RedisJobStore(fake_redis(), keep_s=KEEP_S)
    yield backing
    await backing.aclose()


def job(tenant: str = "acme", *, window_s: int = 3600) -> Batch:
    now = int(time.time())
    return Batch(new_batch_id(), tenant, "file-" + "0" * 24, "/v1/chat/completions", now, now + window_s)


async def test_a_tenant_has_at_most_max_active_unfinished_jobs(store: JobStore) -> None:
    first, second = job(), job()
    assert await store.create(first, max_active=2) and await store.create(second, max_active=2)
    third = job()
    assert not await store.create(third, max_active=2)
    assert await store.get(third.id) is None and third.id not in await store.active()  # nothing of it stored
    assert await store.create(job("globex"), max_active=2)  # another tenant has its own count
    assert await store.create(job(), listed=False, max_active=2)  # a direct job runs in its caller's process
    assert await store.update(msgspec.structs.replace(first, status=Status.completed), {Status.validating})
    await store.deactivate(first.id, first.tenant)  # ended: its place is free
    assert await store.create(third, max_active=2)
    assert not await store.create(job(), max_active=2)


async def test_a_job_whose_window_closed_no_longer_counts(store: JobStore) -> None:
    stale = job(window_s=-1)  # its window closed (its worker died, say): it ends at the next scan
    assert await store.create(stale, max_active=1)
    assert await store.create(job(), max_active=1)


async def test_a_job_that_never_ends_is_forgotten_keep_s_after_its_window() -> None:
    clock = Clock()
    store = MemoryJobStore(keep_s=KEEP_S, clock=clock)
    batch = job()
    await store.create(batch)
    assert await store.record(batch.id, "a", Recorded(1, True, b"x"))
    clock.now = batch.expires_at + KEEP_S - 1
    assert await store.get(batch.id) == batch
    clock.now = batch.expires_at + KEEP_S
    assert await store.get(batch.id) is None
    assert await store.results(batch.id) == [] and (await store.counts(batch.id)).completed == 0


async def test_every_key_of_a_running_job_has_a_ttl_from_its_creation() -> None:
    from pipeline.batch.redis_store import RedisJobStore

    redis = fake_redis()
    store = RedisJobStore(redis, keep_s=KEEP_S)
    batch = job()
    assert await store.create(batch, max_active=5)
    assert await store.record(batch.id, "a", Recorded(1, True, b"x"))
    assert await store.lease(batch.id, "w1", 6.0)
    running = msgspec.structs.replace(batch, status=Status.in_progress, total=2)
    assert await store.update(running, {Status.validating})
    keys = await redis.keys("sluice:batch:*")
    ttls = {k.decode(): await redis.pttl(k) for k in keys if k != b"sluice:batch:active"}
    assert len(ttls) == 6, ttls  # job, out, counts, lease; the tenant's list and its count
    assert all(ttl > 0 for ttl in ttls.values()), ttls
    lifetime_ms = (batch.expires_at + KEEP_S - time.time()) * 1000
    for part in ("job", "out", "counts"):
        assert abs(ttls[f"sluice:batch:{{{batch.id}}}:{part}"] - lifetime_ms) < 5_000, ttls
    ended = msgspec.structs.replace(running, status=Status.completed)
    assert await store.update(ended, {Status.in_progress})
    assert 0 < await redis.pttl(f"sluice:batch:{{{batch.id}}}:job") <= KEEP_S * 1000  # keep_s from its end
    await store.aclose()

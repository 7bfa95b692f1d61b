"""One suite for both JobStores: the in-memory one (unit tests) and the Redis one (what runs), so both keep
the same semantics: compare-and-set on the status, outcomes recorded once and counted once, none after
the job ended, leases, paged listing per tenant, unlisted direct jobs, at most `max_active` unfinished
jobs per tenant (the bridge's 429) with a job whose window closed no longer counted. Then what only Redis
shows: a TTL on every key of a running job from its creation and `keep_s` after it ends, scripts reloaded
after Redis lost them, and InfraUnavailable when it is away."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from pipeline.batch.records import Batch, Recorded, Status, new_batch_id
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.store import JobStore, MemoryJobStore
from pipeline.errors import InfraUnavailable
from pipeline.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")


def client(url: str) -> Redis:
    return Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


@pytest_asyncio.fixture(params=["memory", "redis"], loop_scope="session")
async def store(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[JobStore]:
    backing: JobStore = MemoryJobStore(keep_s=60) if request.param == "memory" else RedisJobStore(client(settings.redis.url), keep_s=60)
    yield backing
    await backing.aclose()


def new_tenant() -> str:
    return "t-" + uuid.uuid4().hex[:8]


def job(tenant: str | None = None, *, window_s: int = 60) -> Batch:
    now = int(time.time())
    return Batch(new_batch_id(), tenant or new_tenant(), "file-" + "0" * 24, "/v1/chat/completions", now, now + window_s)


async def test_create_get_and_compare_and_set_on_the_status(store: JobStore) -> None:
    batch = job()
    assert await store.get(batch.id) is None
    await store.create(batch)
    assert await store.get(batch.id) == batch and batch.id in await store.active()
    running = msgspec.structs.replace(batch, status=Status.in_progress, total=3)
    assert await store.update(running, {Status.validating})
    assert not await store.update(msgspec.structs.replace(running, status=Status.failed), {Status.validating})
    assert await store.get(batch.id) == running
    await store.deactivate(batch.id)
    assert batch.id not in await store.active()


async def test_an_outcome_is_recorded_and_counted_once(store: JobStore) -> None:
    batch = job()
    await store.create(batch)
    assert await store.record(batch.id, "a", Recorded(1, True, b"first"))
    assert not await store.record(batch.id, "a", Recorded(1, False, b"second"))
    assert await store.record(batch.id, "#2", Recorded(2, False, b"refused"))
    counts = await store.counts(batch.id)
    assert (counts.completed, counts.failed) == (1, 1)
    assert await store.recorded_keys(batch.id) == {"a", "#2"}
    assert sorted(r.text for r in await store.results(batch.id)) == [b"first", b"refused"]


async def test_no_outcome_is_recorded_after_the_job_ended(store: JobStore) -> None:
    batch = job()
    await store.create(batch)
    assert await store.update(msgspec.structs.replace(batch, status=Status.completed), {Status.validating})
    assert not await store.record(batch.id, "late", Recorded(1, True, b"x"))
    assert not await store.record(new_batch_id(), "nobody", Recorded(1, True, b"x"))  # no such job
    assert (await store.counts(batch.id)).completed == 0


async def test_a_lease_is_held_by_one_owner_until_it_runs_out_or_is_released(store: JobStore) -> None:
    batch_id = new_batch_id()
    assert await store.lease(batch_id, "w1", 0.3)
    assert await store.lease(batch_id, "w1", 0.3)  # renewed
    assert not await store.lease(batch_id, "w2", 0.3)
    await store.release(batch_id, "w2")  # not the holder: nothing happens
    assert not await store.lease(batch_id, "w2", 0.3)
    await asyncio.sleep(0.4)
    assert await store.lease(batch_id, "w2", 0.3)
    await store.release(batch_id, "w2")
    assert await store.lease(batch_id, "w3", 0.3)


async def test_listing_is_per_tenant_newest_first_and_paged(store: JobStore) -> None:
    tenant = new_tenant()
    made = []
    for _ in range(5):
        made.append(job(tenant))
        await store.create(made[-1])
    await store.create(job())  # another tenant's
    await store.create(job(tenant), listed=False)  # a direct job: not listed
    first, more = await store.list(tenant, None, 2)
    assert [b.id for b in first] == [made[4].id, made[3].id] and more
    rest, more = await store.list(tenant, first[-1].id, 10)
    assert [b.id for b in rest] == [made[2].id, made[1].id, made[0].id] and not more


async def test_a_tenant_has_at_most_max_active_unfinished_jobs(store: JobStore) -> None:
    acme = new_tenant()
    first, second = job(acme), job(acme)
    assert await store.create(first, max_active=2) and await store.create(second, max_active=2)
    third = job(acme)
    assert not await store.create(third, max_active=2)
    assert await store.get(third.id) is None and third.id not in await store.active()  # nothing of it stored
    assert await store.create(job(), max_active=2)  # another tenant has its own count
    assert await store.create(job(acme), listed=False, max_active=2)  # a direct job runs in its caller's process
    assert await store.update(msgspec.structs.replace(first, status=Status.completed), {Status.validating})
    await store.deactivate(first.id, first.tenant)  # ended: its place is free
    assert await store.create(third, max_active=2)
    assert not await store.create(job(acme), max_active=2)


async def test_a_job_whose_window_closed_no_longer_counts(store: JobStore) -> None:
    acme = new_tenant()
    opened, stale = job(acme), job(acme, window_s=-1)  # `stale`: its window closed (its worker died, say)
    assert await store.create(opened, max_active=2) and await store.create(stale, max_active=2)
    assert await store.create(job(acme), max_active=2)  # the stale one ended at this create's scan
    assert not await store.create(job(acme), max_active=2)  # the two open ones count


async def test_every_key_of_a_running_job_expires_from_creation_and_keep_s_after_it_ends(settings: Settings) -> None:
    redis = client(settings.redis.url)
    store = RedisJobStore(client(settings.redis.url), keep_s=30)
    try:
        batch = job()  # its window closes 60 s from now
        assert await store.create(batch, max_active=5)
        assert await store.record(batch.id, "a", Recorded(1, True, b"x"))
        assert await store.lease(batch.id, "w1", 6.0)
        running = msgspec.structs.replace(batch, status=Status.in_progress, total=2)
        assert await store.update(running, {Status.validating})
        # Every key the job made: its own (one hash tag) and its tenant's. Only `active`, shared by all jobs,
        # has no TTL (redis_store.py says why).
        keys = {k.decode() async for k in redis.scan_iter(match=f"sluice:batch:*{batch.id}*")}
        keys |= {k.decode() async for k in redis.scan_iter(match=f"sluice:batch:*:{batch.tenant}")}
        mine = {f"sluice:batch:{{{batch.id}}}:{part}" for part in ("job", "out", "counts", "lease")}
        tenants = {f"sluice:batch:tenant:{batch.tenant}", f"sluice:batch:active:{batch.tenant}"}
        assert keys == mine | tenants, keys
        ttls = {k: await redis.pttl(k) for k in keys}
        lifetime_ms = (batch.expires_at + 30 - time.time()) * 1000  # the window, then keep_s: even if it never ends
        assert all(0 < ttl <= lifetime_ms + 1_000 for ttl in ttls.values()), ttls
        for part in ("job", "out", "counts"):
            assert abs(ttls[f"sluice:batch:{{{batch.id}}}:{part}"] - lifetime_ms) < 5_000, ttls
        assert ttls[f"sluice:batch:{{{batch.id}}}:lease"] <= 6_000, ttls
        assert await store.update(msgspec.structs.replace(running, status=Status.completed), {Status.in_progress})
        ended = [await redis.pttl(f"sluice:batch:{{{batch.id}}}:{part}") for part in ("job", "out", "counts")]
        assert all(0 < ttl <= 30_000 for ttl in ended), ended  # keep_s from its end
    finally:
        await store.aclose()
        await redis.aclose()


async def test_scripts_are_loaded_again_after_redis_lost_them(settings: Settings) -> None:
    redis = client(settings.redis.url)
    store = RedisJobStore(client(settings.redis.url))
    try:
        batch = job()
        await store.create(batch)
        await redis.script_flush()
        assert await store.record(batch.id, "a", Recorded(1, True, b"x"))
    finally:
        await store.aclose()
        await redis.aclose()


async def test_redis_away_is_infra_unavailable() -> None:
    store = RedisJobStore(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2))
    with pytest.raises(InfraUnavailable):
        await store.get(new_batch_id())
    with pytest.raises(InfraUnavailable):
        await store.record(new_batch_id(), "a", Recorded(1, True, b"x"))
    await store.aclose()

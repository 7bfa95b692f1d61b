"""What bounds the job store, on the in-memory store: a job that never ends is forgotten, and a tenant may
have only so many unfinished jobs. The Redis store (its Lua scripts) is held to the same cap, and to a TTL
on every key of a running job, against a real Redis in tests/integration/test_batch_stores.py."""

from __future__ import annotations

import time

import msgspec
import pytest

from pipeline.batch.records import Batch, Recorded, Status, new_batch_id
from pipeline.batch.store import JobStore, MemoryJobStore

pytestmark = pytest.mark.asyncio
KEEP_S = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store() -> JobStore:
    return MemoryJobStore(keep_s=KEEP_S)


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

"""The worker's loops outlive a store that refuses (a Redis ResponseError: READONLY after a failover, OOM,
BUSY) or holds a record it cannot read: the scan goes on, a running job's lease is still renewed and an
API cancel still seen; each error is logged (its type and reason, no payload), an unreadable job once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
from redis.exceptions import ResponseError

from pipeline.batch.records import Batch, Status
from pipeline.batch.store import MemoryJobStore
from tests.unit.batch.fakes import FakeCompleter
from tests.unit.batch.helpers import Harness, jsonl

pytestmark = pytest.mark.asyncio

READONLY = "READONLY You can't write against a read only replica."


class Refusing(MemoryJobStore):
    """Raises the errors queued in `failures[method]`, one per call, then works."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[str, list[Exception]] = {}
        self.leases = 0
        self.unreadable: set[str] = set()  # ids whose record does not decode

    def _fail(self, method: str) -> None:
        if queued := self.failures.get(method):
            raise queued.pop(0)

    async def active(self) -> list[str]:
        self._fail("active")
        return await super().active()

    async def get(self, batch_id: str) -> Batch | None:
        if batch_id in self.unreadable:
            raise msgspec.ValidationError("Expected `str`, got `int` - at `$[1]`")
        self._fail("get")
        return await super().get(batch_id)

    async def lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        self.leases += 1
        self._fail("lease")
        return await super().lease(batch_id, owner, ttl_s)


def _harness(tmp_path: Path, client: FakeCompleter | None = None, **config: object) -> tuple[Harness, Refusing]:
    harness = Harness(tmp_path, client, **config)
    store = harness.store = Refusing()
    return harness, store


async def _until(harness: Harness, batch_id: str, status: Status) -> bool:
    for _ in range(300):
        if (await harness.finished(batch_id)).status is status:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_refused_scan_is_logged_and_the_next_scan_runs_the_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    harness, store = _harness(tmp_path)
    store.failures["active"] = [ResponseError(READONLY)]
    batch = await harness.submit(jsonl(["a", "b"]))
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    done = await _until(harness, batch.id, Status.completed)
    stop.set()
    await asyncio.wait_for(task, 5)  # and it did not end with the error
    assert done, "the worker stopped scanning after the store refused one scan"
    assert "the scan failed (ResponseError: READONLY" in caplog.text


async def test_a_refused_lease_renewal_is_tried_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    client = FakeCompleter()
    client.gate = asyncio.Event()
    harness, store = _harness(tmp_path, client, lease_s=0.15)  # renewed every 0.05 s
    batch = await harness.submit(jsonl(["a"]))
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    while client.in_flight < 1:
        await asyncio.sleep(0.005)
    store.failures["lease"] = [ResponseError(READONLY)]
    await asyncio.sleep(0.05)
    leases = store.leases
    await asyncio.sleep(0.3)
    renewed = store.leases - leases
    client.gate.set()
    finished = await _until(harness, batch.id, Status.completed)
    stop.set()
    await task
    assert renewed >= 3, "the lease keeper ended at the refusal: the lease lapses under a running job"
    assert finished and "the lease was not renewed (ResponseError: READONLY" in caplog.text


async def test_a_cancel_after_a_refused_status_read_is_still_seen(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    client = FakeCompleter()
    client.gate = asyncio.Event()
    harness, store = _harness(tmp_path, client, max_in_flight=1)
    batch = await harness.submit(jsonl(["a", "b", "c"]))
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    while client.in_flight < 1:
        await asyncio.sleep(0.005)
    store.failures["get"] = [ResponseError("BUSY Redis is busy running a script.")]  # the watcher's next read
    await asyncio.sleep(0.1)
    current = await harness.finished(batch.id)
    assert await store.update(msgspec.structs.replace(current, status=Status.cancelling, cancelling_at=1), {Status.in_progress})
    cancelled = await _until(harness, batch.id, Status.cancelled)
    stop.set()
    client.gate.set()
    await task
    assert cancelled, "the cancel watcher ended at the refusal: the API's cancel was missed"
    assert "the status could not be read (ResponseError: BUSY" in caplog.text


async def test_a_job_whose_record_cannot_be_read_is_skipped_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    harness, store = _harness(tmp_path)
    broken = await harness.submit(jsonl(["x"]))
    good = await harness.submit(jsonl(["a"]))
    store.unreadable.add(broken.id)
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    done = await _until(harness, good.id, Status.completed)
    await asyncio.sleep(0.1)  # several scans more
    stop.set()
    await asyncio.wait_for(task, 5)
    assert done, "the worker stopped at a record it cannot read"
    skipped = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(skipped) == 1 and broken.id in skipped[0].getMessage()
    assert "Expected `str`" in skipped[0].getMessage() and "ValidationError" in skipped[0].getMessage()

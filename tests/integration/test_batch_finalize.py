"""Two workers finalizing one job on the Redis store, as a worker paused past its lease and the one that took
the job over can: the files of a completed job are whole whatever the interleaving. The case a reviewer
reproduced: the late finalizer's HSCAN of the outcomes is held after its first page (of 1000) while the other
finishes the job and deletes them; before the fix it then wrote its 1000 lines over the complete file."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from pipeline.batch.config import BatchSettings
from pipeline.batch.files import FileStore
from pipeline.batch.records import Batch, Recorded, Status, new_batch_id
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.worker import BatchWorker
from pipeline.settings import Settings
from tests.unit.batch.helpers import CHAT, jsonl

pytestmark = pytest.mark.asyncio(loop_scope="session")
LINES = 3000


def client(url: str) -> Redis:
    return Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


def worker(store: RedisJobStore, files: FileStore, owner: str) -> BatchWorker:
    def no_executor(batch: Batch) -> Any:
        raise AssertionError("a finalizing job runs no line")

    return BatchWorker(BatchSettings(), store, files, no_executor, owner=owner)


async def test_a_late_finalizer_never_writes_part_of_the_outcomes_over_a_finished_jobs_file(
    settings: Settings, tmp_path: Path,
) -> None:
    files = FileStore(tmp_path, max_bytes=1 << 20, max_lines=10)
    held_client = client(settings.redis.url)
    first, late = RedisJobStore(client(settings.redis.url), keep_s=60), RedisJobStore(held_client, keep_s=60)
    first_page_read, go_on = asyncio.Event(), asyncio.Event()
    hscan = held_client.hscan
    pages = 0

    async def held_hscan(*args: Any, **kwargs: Any) -> Any:  # the late finalizer pauses before its second page
        nonlocal pages
        pages += 1
        if pages == 2:
            first_page_read.set()
            await go_on.wait()
        return await hscan(*args, **kwargs)

    held_client.hscan = held_hscan  # type: ignore[method-assign]
    try:
        tenant = "t-" + uuid.uuid4().hex[:8]
        upload = files.upload(tenant, "in.jsonl", io.BytesIO(jsonl(["x"])))
        now = int(time.time())
        batch = Batch(new_batch_id(), tenant, upload.id, CHAT, now, now + 3600)
        assert await first.create(batch)
        for line in range(1, LINES + 1):
            assert await first.record(batch.id, f"c{line}", Recorded(line, True, json.dumps({"line": line}).encode()))
        finalizing = msgspec.structs.replace(batch, status=Status.finalizing, total=LINES)
        assert await first.update(finalizing, {Status.validating})

        reading = asyncio.create_task(worker(late, files, "late").drive(batch.id, asyncio.Event()))
        await asyncio.wait_for(first_page_read.wait(), 10)
        await worker(first, files, "first").drive(batch.id, asyncio.Event())  # ends the job, drops its outcomes
        go_on.set()
        await asyncio.wait_for(reading, 10)

        ended = await first.get(batch.id)
        assert ended is not None and ended.status is Status.completed and ended.output_file_id is not None
        written = files.path(files.get(tenant, ended.output_file_id)).read_bytes().splitlines()
        assert len(written) == LINES
        assert [json.loads(x)["line"] for x in written] == list(range(1, LINES + 1))
        assert pages >= 2  # the late one did read part of the outcomes, then found the job ended
    finally:
        go_on.set()
        await first.aclose()
        await late.aclose()

"""`sluice batch run`: a job for a service that uses Kafka directly, with no bridge in between.

The job is the bridge's kind of job (files under `batch.dir`, progress in Redis, the same worker), but
unlisted: no bridge picks it up, only this process drives it, with the caller's key held in memory and
given to the SDK, which signs each request with it. Its id comes from who runs it and the file's bytes,
so the same command run again finds the job and resumes it, running only the lines without an outcome.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.batch.errors import Invalid, NotFound
from pipeline.batch.execute import Executor
from pipeline.batch.records import TERMINAL, Batch
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.service import file_store
from pipeline.batch.worker import BatchWorker
from pipeline.gateway.build import redis_client
from pipeline.gateway.keys import hash_key, well_formed
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.sdk import Client
from pipeline.settings import Settings

Show = Callable[[Any, Any, Any], Awaitable[Any]]


class DirectJob:
    def __init__(self, settings: Settings, api_key: str | None) -> None:
        if api_key is not None and not well_formed(api_key):
            raise Invalid("direct mode takes a sluice API key (sk-sluice-...)")
        self.settings = settings
        self._redis = redis_client(settings)
        self.store = RedisJobStore(self._redis, keep_s=settings.batch.keep_s)  # closes the client
        self.files = file_store(settings)
        self.client = Client(settings, reply_name="sdk")
        self._api_key = api_key
        self.tenant = settings.gateway.anonymous_tenant

    async def start(self) -> None:
        if self._api_key is not None:
            keys = RedisKeyStore(self._redis)
            entry = await keys.lookup(hash_key(self._api_key))
            if entry is None or not entry.valid(time.time()):
                raise Invalid("the API key is not valid")
            self.tenant = entry.record.tenant
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()
        await self.store.aclose()

    async def prepare(self, source: BinaryIO, filename: str, digest: str, endpoint: str) -> Batch:
        """The job for this caller and file: found again, or created (the file copied under `batch.dir`)."""
        who = hash_key(self._api_key) if self._api_key else "anonymous"
        job_id = "batch_" + hashlib.sha256(f"{self.tenant}\n{who}\n{digest}\n{endpoint}".encode()).hexdigest()[:24]
        existing = await self.store.get(job_id)
        if existing is not None:
            return existing
        file_id = "file-" + hashlib.sha256(f"direct-input/{job_id}".encode()).hexdigest()[:24]
        try:
            self.files.get(self.tenant, file_id)
        except NotFound:
            await asyncio.to_thread(self.files.upload, self.tenant, filename, source, file_id=file_id)
        now = int(time.time())
        batch = Batch(job_id, self.tenant, file_id, endpoint, now, now + int(self.settings.batch.completion_window_s))
        await self.store.create(batch, listed=False)
        return batch

    async def run(self, batch: Batch, *, show: Show | None = None) -> Batch:
        """Drives the job to its end (showing progress with `show`); returns it as stored at the end."""
        if batch.status in TERMINAL:
            return batch
        b = self.settings.batch

        def executor_for(job: Batch) -> Executor:
            return Executor(self.client, lambda r: r, deadline_s=b.line_deadline_s, max_attempts=b.max_attempts,
                            api_key=self._api_key)

        worker = BatchWorker(b, self.store, self.files, executor_for)
        stop = asyncio.Event()
        driving = asyncio.create_task(worker.drive_one(batch.id, stop))
        try:
            if show is not None:
                async def poll() -> tuple[Batch | None, Any]:
                    return await self.store.get(batch.id), await self.store.counts(batch.id)

                def counts_of(state: tuple[Batch | None, Any]) -> dict[str, int]:
                    job, counts = state
                    return {"total": job.total if job else 0, "completed": counts.completed, "failed": counts.failed}

                await show(poll, counts_of, lambda state: driving.done())
            await driving
        finally:
            stop.set()
            if not driving.done():
                await asyncio.gather(driving, return_exceptions=True)
        return await self.store.get(batch.id) or batch

    def copy_results(self, batch: Batch, output: Path, errors: Path) -> None:
        for file_id, path in ((batch.output_file_id, output), (batch.error_file_id, errors)):
            if file_id is None:
                path.write_bytes(b"")
            else:
                path.write_bytes(self.files.path(self.files.get(batch.tenant, file_id)).read_bytes())

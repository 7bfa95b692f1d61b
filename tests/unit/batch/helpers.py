"""A job on the in-memory store with a fake client: what the worker tests share."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

from pipeline.batch.config import BatchSettings
from pipeline.batch.execute import Executor
from pipeline.batch.files import FileStore
from pipeline.batch.records import Batch, new_batch_id
from pipeline.batch.store import MemoryJobStore
from pipeline.batch.worker import BatchWorker
from tests.unit.batch.fakes import FakeCompleter

CHAT = "/v1/chat/completions"


def jsonl(prompts: list[str], *, prefix: str = "c") -> bytes:
    rows = [{"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT,
             "body": {"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 4}} for i, p in enumerate(prompts)]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class Harness:
    def __init__(self, tmp: Path, client: FakeCompleter | None = None, **config: object) -> None:
        self.config = BatchSettings(**{"max_in_flight": 4, "admission_rps": 0.0, "lease_s": 1.0, **config})  # type: ignore[arg-type]
        self.store = MemoryJobStore()
        c = self.config
        self.files = FileStore(tmp, max_bytes=c.max_file_bytes, max_lines=c.max_lines, max_tenant_bytes=c.max_tenant_bytes,
                               upload_keep_s=c.upload_keep_s or None, output_keep_s=c.keep_s)
        self.client = client or FakeCompleter()

    def worker(self, client: FakeCompleter | None = None, **kwargs: object) -> BatchWorker:
        client = client or self.client

        def executor_for(batch: Batch) -> Executor:
            return Executor(client, lambda r: r, deadline_s=60, max_attempts=2, sleep=lambda s: asyncio.sleep(0))

        return BatchWorker(self.config, self.store, self.files, executor_for, poll_s=0.02, **kwargs)  # type: ignore[arg-type]

    async def submit(self, data: bytes, tenant: str = "t", *, expires_in: int = 3600, batch_id: str | None = None) -> Batch:
        record = self.files.upload(tenant, "in.jsonl", io.BytesIO(data))
        now = int(time.time())
        batch = Batch(batch_id or new_batch_id(), tenant, record.id, CHAT, now, now + expires_in)
        await self.store.create(batch)
        return batch

    async def finished(self, batch_id: str) -> Batch:
        batch = await self.store.get(batch_id)
        assert batch is not None
        return batch

    def lines(self, file_id: str | None, tenant: str = "t") -> list[dict]:
        assert file_id is not None
        path = self.files.path(self.files.get(tenant, file_id))
        return [json.loads(x) for x in path.read_bytes().splitlines()]

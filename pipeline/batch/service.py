"""How the batch parts are put together from settings, for the bridge, `sluice batch worker` and
`sluice batch run`: the file store, the job store, and how a job's lines are signed as its owner."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import msgspec

from pipeline.batch.execute import Executor
from pipeline.batch.files import FileStore
from pipeline.batch.records import Batch
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.worker import BatchWorker
from pipeline.errors import StageError
from pipeline.gateway.build import redis_client
from pipeline.gateway.principal import sign
from pipeline.sdk import Client
from pipeline.settings import REPO_ROOT, Settings
from topics.errors import ErrorCode
from topics.requests import Request

log = logging.getLogger(__name__)


def file_store(settings: Settings) -> FileStore:
    b = settings.batch
    root = REPO_ROOT / b.dir  # an absolute `dir` stays as it is
    return FileStore(root, max_bytes=b.max_file_bytes, max_lines=b.max_lines, max_tenant_bytes=b.max_tenant_bytes,
                     upload_keep_s=b.upload_keep_s or None, output_keep_s=b.keep_s)


def job_store(settings: Settings) -> RedisJobStore:
    return RedisJobStore(redis_client(settings), keep_s=settings.batch.keep_s)


def signer_for(secret: str, clock: Callable[[], float] = time.time) -> Callable[[Batch], Callable[[Request], Request]]:
    """How a job's requests are signed as its owner (pipeline/gateway/principal.py): the key's hash or
    the JWT's claims, HMAC-signed with the gateway secret for that one request, like the bridge's own,
    valid until the request's deadline or the JWT's expiry if sooner. Once the JWT has expired no line
    is signed: each is refused here as ingest would refuse it (StageError `unauthorized`, recorded as
    the line's answer by the executor), so a token with a second left cannot run a day-long job."""

    def for_batch(batch: Batch) -> Callable[[Request], Request]:
        owner = batch.signer

        def apply(request: Request) -> Request:
            if owner is None:
                return msgspec.structs.replace(request, api_key=None)
            if owner.expired(clock()):
                raise StageError(ErrorCode.unauthorized, "the token has expired")
            expires_at = request.created_at + request.deadline_s
            if owner.expires_at is not None:
                expires_at = min(expires_at, owner.expires_at)
            return sign(secret, request, owner.kind, owner.subject, expires_at, tenant=owner.tenant, models=owner.models)

        return apply

    return for_batch


def executor_factory(settings: Settings, client: Client) -> Callable[[Batch], Executor]:
    signer = signer_for(settings.gateway.client_info_secret)
    b = settings.batch
    return lambda batch: Executor(client, signer(batch), deadline_s=b.line_deadline_s, max_attempts=b.max_attempts)


async def run_worker(settings: Settings) -> None:
    """`sluice batch worker`: runs jobs until SIGINT or SIGTERM (its jobs then move to another worker)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    store = job_store(settings)
    async with Client(settings, reply_name="sdk") as client:
        worker = BatchWorker(settings.batch, store, file_store(settings), executor_factory(settings, client))
        log.info("batch worker %s running", worker.owner)
        try:
            await worker.run(stop)
        finally:
            await store.aclose()

"""OpenAI's Files and Batch APIs on the bridge (pipeline/batch/ does the work):

    POST /v1/files                  upload a batch input file (multipart, purpose "batch"); size and line limits;
                                    408 past bridge.body_timeout_s plus a second per 64 KiB received
    GET  /v1/files                  the tenant's files, newest first (purpose, limit, order, after)
    GET  /v1/files/{id}             the file object
    DELETE /v1/files/{id}           delete it (a job still reading it then fails)
    GET  /v1/files/{id}/content     its bytes (input, output or error file)
    POST /v1/batches                a job over an uploaded file: {input_file_id, endpoint, completion_window, metadata};
                                    429 when the tenant has `batch.max_active_per_tenant` jobs unfinished
    GET  /v1/batches                the caller's jobs, newest first (`after`, `limit`)
    GET  /v1/batches/{id}           one job, with live request_counts
    POST /v1/batches/{id}/cancel    cancelling -> cancelled (what finished is kept)

Files and jobs belong to the tenant that created them: the caller's tenant comes from its key's record
(looked up by hash), its JWT's verified tenant claim, or `gateway.anonymous_tenant` where auth is not
required; another tenant's file or job answers 404, like one that does not exist. A job's lines run as
its owner (ingest authenticates each one): the job stores the key's hash or the JWT's claims and the
worker signs each request with the gateway secret; no raw credential is ever stored. Without a gateway
secret (SLUICE_GATEWAY_SECRET; `make run` makes one) only anonymous jobs can run.

`BatchApi.running()` is entered by the app's lifespan: it runs the job worker in this process when
`batch.run_in_bridge` is set (any number of bridges: each job is leased to one at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from redis.asyncio import Redis
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from pipeline.batch.config import BatchSettings
from pipeline.batch.errors import BatchError, Conflict, Invalid, NotFound, TooLarge, TooMany
from pipeline.batch.files import FileStore
from pipeline.batch.records import ENDPOINTS, TERMINAL, Batch, Signer, Status, new_batch_id, valid_batch_id
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.service import executor_factory, file_store
from pipeline.batch.store import JobStore
from pipeline.batch.worker import BatchWorker
from pipeline.bridge.app import read_capped
from pipeline.bridge.credentials import Credential, Credentials, KeysAway
from pipeline.bridge.openai_format import RequestTimeout, Unauthorized, decode_body, error_body
from pipeline.gateway.build import redis_client
from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.gateway import INVALID_KEY
from pipeline.gateway.keys import KeyStore, confirmed
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.sdk import Client
from pipeline.settings import Settings

log = logging.getLogger(__name__)
MAX_LIST = 100
MAX_METADATA = 16  # OpenAI's limit on metadata pairs
MAX_CREATE_BYTES = 64 * 1024  # a batch request is a file id, an endpoint and metadata
UPLOAD_MIN_RATE = 64 * 1024  # bytes a second: an upload gets bridge.body_timeout_s plus a second per this many bytes
Handler = Callable[[HttpRequest], Awaitable[Response]]


@dataclass(frozen=True)
class Owner:
    tenant: str
    signer: Signer | None  # None: anonymous


class BatchApi:
    def __init__(self, settings: Settings, client: Client, credentials: Credentials, *,
                 store: JobStore | None = None, keys: KeyStore | None = None, files: FileStore | None = None) -> None:
        self.settings = settings
        self.config: BatchSettings = settings.batch
        self._client = client
        self._credentials = credentials
        self._redis: Redis | None = None
        if store is None or keys is None:
            self._redis = redis_client(settings)
        self.store: JobStore = store or RedisJobStore(self._redis, keep_s=self.config.keep_s)  # type: ignore[arg-type]
        self._keys: KeyStore = keys or RedisKeyStore(self._redis)  # type: ignore[arg-type]
        self.files = files or file_store(settings)

    def routes(self) -> list[Route]:
        if not self.config.enabled:
            return []
        return [
            Route("/v1/files", _answering(self.upload), methods=["POST"]),
            Route("/v1/files", _answering(self.list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", _answering(self.file), methods=["GET"]),
            Route("/v1/files/{file_id}", _answering(self.delete), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", _answering(self.content), methods=["GET"]),
            Route("/v1/batches", _answering(self.create), methods=["POST"]),
            Route("/v1/batches", _answering(self.list), methods=["GET"]),
            Route("/v1/batches/{batch_id}", _answering(self.retrieve), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", _answering(self.cancel), methods=["POST"]),
        ]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The job worker for as long as the app runs (when `batch.run_in_bridge`)."""
        stop = asyncio.Event()
        task = None
        if self.config.enabled and self.config.run_in_bridge:
            worker = BatchWorker(self.config, self.store, self.files, executor_factory(self.settings, self._client))
            task = asyncio.create_task(worker.run(stop), name="batch worker")
        try:
            yield
        finally:
            stop.set()
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
            if self._redis is not None:
                await self._redis.aclose()

    async def owner(self, request: HttpRequest) -> Owner:
        if self.settings.gateway.auth_required and _bearer(request) is None:
            raise Unauthorized("an API key is required (Authorization: Bearer sk-sluice-...)")
        return await self.owner_of_credential(await self._credentials.resolve(_bearer(request)))

    async def owner_of_credential(self, credential: Credential) -> Owner:
        """`owner_of` with this bridge's key store: a key must be found there and valid (one lookup; 503
        `KeysAway` if the store does not answer); a JWT was verified by `Credentials.resolve`."""
        return await owner_of(credential, self._keys, self.settings)

    async def upload(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        cap = self.config.max_file_bytes + 64 * 1024  # the form's own bytes around the file
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise TooLarge(f"the upload is {declared} bytes; a batch file may have {self.config.max_file_bytes}", "file")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise Invalid("upload the file as multipart/form-data with fields `file` and `purpose`", "file")
        timeout_s = self.settings.bridge.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                pieces = _capped(request.stream(), cap, _Pace(deadline, timeout_s))
                form = await MultiPartParser(request.headers, pieces, max_files=1, max_fields=8).parse()
        except MultiPartException as exc:
            raise Invalid(f"the upload is not a form sluice can read: {exc.message}", "file") from None
        except TimeoutError:
            raise RequestTimeout(f"the upload did not arrive within {timeout_s:g} s and one more second per "
                                 f"{UPLOAD_MIN_RATE // 1024} KiB") from None
        try:
            purpose = form.get("purpose")
            if purpose != "batch":
                raise Invalid("`purpose` must be \"batch\" (the only files sluice keeps)", "purpose")
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise Invalid("the form has no `file`", "file")
            await upload.seek(0)
            record = await asyncio.to_thread(self.files.upload, owner.tenant, upload.filename or "", upload.file)
        finally:
            await form.close()
        log.info("file %s uploaded by tenant %s: %d bytes", record.id, owner.tenant, record.bytes)
        return JSONResponse(record.to_openai(self.files.expires_at(record)))

    async def list_files(self, request: HttpRequest) -> Response:
        """OpenAI's files.list: `purpose`, `limit` (1 to 10,000), `order` (desc, asc) and `after`."""
        owner = await self.owner(request)
        query = request.query_params
        limit = _limit(query.get("limit", "10000"), 10_000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise Invalid("`order` must be asc or desc", "order")
        found, more = await asyncio.to_thread(self.files.list, owner.tenant, purpose=query.get("purpose"),
                                              after=query.get("after"), limit=limit, newest_first=order == "desc")
        data = [f.to_openai(self.files.expires_at(f)) for f in found]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def file(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        record = self.files.get(owner.tenant, request.path_params["file_id"])
        return JSONResponse(record.to_openai(self.files.expires_at(record)))

    async def delete(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        file_id = request.path_params["file_id"]
        self.files.delete(owner.tenant, file_id)
        log.info("file %s deleted by tenant %s", file_id, owner.tenant)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def content(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        record = self.files.get(owner.tenant, request.path_params["file_id"])
        return FileResponse(self.files.path(record), media_type="application/jsonl", filename=record.filename)

    async def create(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        body = decode_body(await read_capped(request, MAX_CREATE_BYTES, self.settings.bridge.body_timeout_s))
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise Invalid(f"`endpoint` must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise Invalid("`completion_window` must be \"24h\"", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
                                         and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise Invalid(f"`metadata` must be an object of at most {MAX_METADATA} string values", "metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise Invalid("`input_file_id` must be a file id", "input_file_id")
        record = self.files.get(owner.tenant, file_id)
        if record.purpose != "batch":
            raise Invalid("the input file must have purpose \"batch\"", "input_file_id")
        if owner.signer is not None and not self.settings.gateway.client_info_secret:
            raise Invalid("a batch for an API key or JWT needs the gateway secret (SLUICE_GATEWAY_SECRET): sluice "
                          "never stores a raw credential, it signs each line as you with that secret")
        now = int(time.time())
        batch = Batch(new_batch_id(), owner.tenant, file_id, endpoint, now, now + int(self.config.completion_window_s),
                      metadata=metadata, signer=owner.signer)
        if not await self.store.create(batch, max_active=self.config.max_active_per_tenant):
            most = self.config.max_active_per_tenant
            raise TooMany(f"this tenant already has {most} unfinished batches, the most it may have at once: "
                          "wait for one to end, or cancel one")
        log.info("batch %s created by tenant %s over %s", batch.id, owner.tenant, file_id)
        return JSONResponse(batch.to_openai(await self.store.counts(batch.id)))

    async def retrieve(self, request: HttpRequest) -> Response:
        batch = await self._owned(request)
        return JSONResponse(batch.to_openai(await self.store.counts(batch.id)))

    async def list(self, request: HttpRequest) -> Response:
        owner = await self.owner(request)
        after = request.query_params.get("after")
        limit = _limit(request.query_params.get("limit", "20"), MAX_LIST)
        batches, more = await self.store.list(owner.tenant, after, limit)
        data = [b.to_openai(await self.store.counts(b.id)) for b in batches]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def cancel(self, request: HttpRequest) -> Response:
        batch = await self._owned(request)
        if batch.status in TERMINAL:
            raise Conflict(f"the batch is already {batch.status.value}")
        if batch.status in (Status.validating, Status.in_progress):
            cancelling = msgspec.structs.replace(batch, status=Status.cancelling, cancelling_at=int(time.time()))
            if await self.store.update(cancelling, {Status.validating, Status.in_progress}):
                batch = cancelling
            else:
                batch = await self.store.get(batch.id) or batch
        return JSONResponse(batch.to_openai(await self.store.counts(batch.id)))

    async def _owned(self, request: HttpRequest) -> Batch:
        owner = await self.owner(request)
        batch_id = request.path_params["batch_id"]
        batch = await self.store.get(batch_id) if valid_batch_id(batch_id) else None
        if batch is None or batch.tenant != owner.tenant:
            raise NotFound(f"no batch {batch_id[:64]!r}")
        return batch


async def owner_of(credential: Credential, keys: KeyStore, settings: Settings) -> Owner:
    """Whose files and jobs these are: the tenant of the key (looked up by its hash), of the JWT, or the
    anonymous tenant; and who the job's lines run as."""
    if credential.kind is None:
        return Owner(settings.gateway.anonymous_tenant, None)
    if credential.kind == "jwt":
        if not credential.tenant:
            raise Unauthorized("the token names no tenant")
        signer = Signer("jwt", credential.subject, credential.tenant, credential.models, expires_at=credential.expires_at)
        return Owner(credential.tenant, signer)  # its lines stop at the JWT's expiry (batch/service.signer_for)
    try:
        entry = await keys.lookup(credential.subject)
        entry = await confirmed(keys, credential.subject, entry) if entry is not None else None
    except StoreUnavailable:
        raise KeysAway("credentials cannot be checked right now", retry_after_s=1.0) from None
    if entry is None or not entry.valid(time.time()):
        raise Unauthorized(INVALID_KEY)
    return Owner(entry.record.tenant, Signer("key", credential.subject))


def _answering(handler: Handler) -> Handler:
    """The handler, with batch errors answered as OpenAI error bodies with their status."""

    async def endpoint(request: HttpRequest) -> Response:
        try:
            return await handler(request)
        except BatchError as exc:
            return JSONResponse(error_body(exc.message, code=exc.code, param=exc.param), status_code=exc.status)

    return endpoint


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _limit(raw: str, most: int) -> int:
    """A list endpoint's `limit` query parameter, 1 to `most`."""
    try:
        limit = int(raw)
    except ValueError:
        raise Invalid("`limit` must be an integer", "limit") from None
    if not 1 <= limit <= most:
        raise Invalid(f"`limit` must be 1 to {most}", "limit")
    return limit


class _Pace:
    """An upload's deadline: `bridge.body_timeout_s` from its start, and one second more per
    `UPLOAD_MIN_RATE` bytes received (Apache's mod_reqtimeout `MinRate`). A chat body is small and gets
    the timeout whole; a batch file of up to `batch.max_file_bytes` arrives over a slower link, but a
    client that stalls or trickles below the rate is still cut off (408)."""

    def __init__(self, deadline: asyncio.Timeout, timeout_s: float) -> None:
        self._deadline = deadline
        self._until = asyncio.get_running_loop().time() + timeout_s

    def received(self, size: int) -> None:
        self._until += size / UPLOAD_MIN_RATE
        self._deadline.reschedule(self._until)


async def _capped(stream: AsyncGenerator[bytes, None], cap: int, pace: _Pace) -> AsyncGenerator[bytes, None]:
    size = 0
    async for piece in stream:
        size += len(piece)
        if size > cap:
            raise TooLarge(f"the upload is over the limit of {cap} bytes", "file")
        pace.received(len(piece))
        yield piece


__all__ = ["BatchApi", "Owner", "owner_of"]

"""The Files and Batch endpoints with the official `openai` client (only base_url changed), on the
in-memory job store and a fake pipeline client: the whole lifecycle, paging, cancel, errors, tenant
isolation (another tenant's files and batches are 404), and the limits per tenant (unfinished batches,
stored bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from pipeline.batch.store import MemoryJobStore
from pipeline.bridge.batches import BatchApi, owner_of
from pipeline.bridge.credentials import Credential, Credentials
from pipeline.bridge.openai_format import BridgeError
from pipeline.gateway.keys import KeyRecord, MemoryKeyStore, hash_key, new_key
from pipeline.settings import Settings
from tests.unit.batch.fakes import FakeCompleter
from tests.unit.batch.helpers import jsonl

KEYS = {"acme": new_key(), "globex": new_key()}


async def _bridge_error(request: HTTPConnection, exc: Exception) -> Response:
    assert isinstance(exc, BridgeError)
    return JSONResponse(exc.body(), status_code=exc.status)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, FakeCompleter, BatchApi]]:
    with serving(tmp_path) as served:
        yield served


@contextlib.contextmanager
def serving(tmp_path: Path, **batch: object) -> Iterator[tuple[TestClient, FakeCompleter, BatchApi]]:
    base = Settings()
    settings = dataclasses.replace(
        base, gateway=dataclasses.replace(base.gateway, auth_required=True, client_info_secret="test-secret"),
        batch=dataclasses.replace(base.batch, **{"dir": str(tmp_path / "batch"), "max_lines": 100, "max_file_bytes": 100_000,
                                                 "admission_rps": 0.0, "lease_s": 2.0, **batch}),  # type: ignore[arg-type]
    )
    keys = MemoryKeyStore()
    completer = FakeCompleter()
    api = BatchApi(settings, completer, Credentials(settings.gateway), store=MemoryJobStore(), keys=keys)  # type: ignore[arg-type]
    app = Starlette(routes=api.routes(), lifespan=lambda app: api.running(), exception_handlers={BridgeError: _bridge_error})
    with TestClient(app) as http:
        for tenant, key in KEYS.items():
            http.portal.call(keys.save, KeyRecord(key_id="key_" + tenant, tenant=tenant, hashes={hash_key(key): 0.0}))
        yield http, completer, api


def client(http: TestClient, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[tenant], http_client=http, max_retries=0)


def wait_for(oa: openai.OpenAI, batch_id: str, statuses: set[str]) -> openai.types.Batch:
    for _ in range(500):
        batch = oa.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.01)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def test_the_official_client_runs_a_batch_end_to_end(app) -> None:  # type: ignore[no-untyped-def]
    http, completer, _ = app
    oa = client(http, "acme")
    uploaded = oa.files.create(file=("in.jsonl", jsonl(["a", "b", "c"])), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(["a", "b", "c"]))
    assert oa.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert oa.files.content(uploaded.id).content == jsonl(["a", "b", "c"])
    batch = oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_for(oa, batch.id, {"completed"})
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed) == (3, 3)
    assert done.output_file_id and done.error_file_id is None and done.in_progress_at and done.completed_at
    lines = oa.files.content(done.output_file_id).text.splitlines()
    out = [json.loads(x) for x in lines]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2"]
    assert out[1]["response"]["body"]["choices"][0]["message"]["content"] == "answer to b"
    assert sorted(completer.runs) == ["a", "b", "c"]
    signed = completer.requests[0]
    assert signed.api_key is None and signed.principal_token is not None  # signed as its owner, no raw key
    assert signed.principal_token.subject == hash_key(KEYS["acme"]) and signed.priority.value == "batch"


def test_listing_is_newest_first_and_pages_with_after(app) -> None:  # type: ignore[no-untyped-def]
    http, _, _ = app
    oa = client(http, "acme")
    file_id = oa.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id
    ids = [oa.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
           for _ in range(5)]
    first = oa.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    every = [b.id for b in oa.batches.list(limit=2)]  # the client follows `after` from page to page
    assert every == ids[::-1]
    assert client(http, "globex").batches.list().data == []


def test_another_tenant_gets_404_for_files_and_batches(app) -> None:  # type: ignore[no-untyped-def]
    http, _, _ = app
    acme, globex = client(http, "acme"), client(http, "globex")
    file_id = acme.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id
    batch_id = acme.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
    for call in (lambda: globex.files.retrieve(file_id), lambda: globex.files.content(file_id),
                 lambda: globex.batches.retrieve(batch_id), lambda: globex.batches.cancel(batch_id),
                 lambda: globex.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        globex.files.delete(file_id)
    assert acme.batches.retrieve(batch_id).id == batch_id
    assert acme.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(file_id)


def test_cancel_ends_a_running_batch_cancelled(app) -> None:  # type: ignore[no-untyped-def]
    http, completer, _ = app
    completer.gate = http.portal.call(asyncio.Event)  # every line waits: the job is mid-way when cancelled
    oa = client(http, "acme")
    file_id = oa.files.create(file=("in.jsonl", jsonl([f"q{i}" for i in range(50)])), purpose="batch").id
    batch = oa.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(oa, batch.id, {"in_progress"})
    cancelling = oa.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(oa, batch.id, {"cancelled"})
    assert done.cancelled_at and done.request_counts is not None and done.request_counts.failed == 50
    with pytest.raises(openai.APIStatusError) as caught:
        oa.batches.cancel(batch.id)
    assert caught.value.status_code == 409


def test_bad_uploads_and_batch_requests_are_refused_with_openai_errors(app) -> None:  # type: ignore[no-untyped-def]
    http, _, _ = app
    oa = client(http, "acme")
    with pytest.raises(openai.BadRequestError, match="empty"):
        oa.files.create(file=("in.jsonl", b""), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oa.files.create(file=("in.jsonl", jsonl(["a"])), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as caught:
        oa.files.create(file=("in.jsonl", b"{}\n" * 40_000), purpose="batch")
    assert caught.value.status_code == 413
    file_id = oa.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        oa.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        oa.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        oa.batches.retrieve("batch_../../x")
    anonymous = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.batches.list()


def test_a_keyed_batch_needs_the_gateway_secret_and_an_anonymous_one_does_not(tmp_path: Path) -> None:
    base = Settings()
    settings = dataclasses.replace(base, batch=dataclasses.replace(base.batch, dir=str(tmp_path), run_in_bridge=False))
    keys = MemoryKeyStore()
    api = BatchApi(settings, FakeCompleter(), Credentials(settings.gateway), store=MemoryJobStore(), keys=keys)  # type: ignore[arg-type]
    app = Starlette(routes=api.routes(), lifespan=lambda app: api.running(), exception_handlers={BridgeError: _bridge_error})
    with TestClient(app) as http:
        http.portal.call(keys.save, KeyRecord(key_id="key_acme", tenant="acme", hashes={hash_key(KEYS["acme"]): 0.0}))
        keyed = client(http, "acme")
        file_id = keyed.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id
        with pytest.raises(openai.BadRequestError, match="SLUICE_GATEWAY_SECRET"):
            keyed.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        anonymous = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        anon_file = anonymous.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id
        batch = anonymous.batches.create(input_file_id=anon_file, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.status == "validating"
        with pytest.raises(openai.NotFoundError):  # the anonymous tenant is another tenant
            anonymous.files.retrieve(file_id)


def test_a_tenant_past_its_unfinished_batches_gets_429_until_one_ends(tmp_path: Path) -> None:
    with serving(tmp_path, max_active_per_tenant=2) as (http, completer, _):
        completer.gate = http.portal.call(asyncio.Event)  # the jobs stay unfinished
        acme, globex = client(http, "acme"), client(http, "globex")
        file_id = acme.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id

        def create(oa: openai.OpenAI, file_id: str) -> openai.types.Batch:
            return oa.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

        first, _ = create(acme, file_id), create(acme, file_id)
        with pytest.raises(openai.RateLimitError, match="already has 2 unfinished batches") as caught:
            create(acme, file_id)
        assert caught.value.status_code == 429 and caught.value.code == "rate_limited"
        assert [b.id for b in acme.batches.list()].count(first.id) == 1 and len(acme.batches.list().data) == 2
        create(globex, globex.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch").id)  # its own count
        acme.batches.cancel(first.id)
        wait_for(acme, first.id, {"cancelled"})
        assert create(acme, file_id).status == "validating"


def test_uploads_past_the_tenants_quota_get_413_and_files_say_when_they_expire(tmp_path: Path) -> None:
    data = jsonl(["a"] * 20)
    with serving(tmp_path, max_tenant_bytes=len(data) * 3 // 2, upload_keep_s=7 * 86400.0) as (http, _, _):
        acme = client(http, "acme")
        uploaded = acme.files.create(file=("in.jsonl", data), purpose="batch")
        assert uploaded.expires_at == uploaded.created_at + 7 * 86400
        assert acme.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
        assert [f.expires_at for f in acme.files.list()] == [uploaded.expires_at]
        with pytest.raises(openai.APIStatusError, match="quota") as caught:
            acme.files.create(file=("in.jsonl", data), purpose="batch")
        assert caught.value.status_code == 413
        assert client(http, "globex").files.create(file=("in.jsonl", data), purpose="batch").bytes == len(data)


def test_a_batch_created_with_a_jwt_keeps_the_tokens_expiry_and_a_keyed_one_none() -> None:
    """The job's lines stop being signed at the JWT's expiry (batch/service.signer_for), so the owner
    recorded at creation must carry it; a key has none of its own (ingest looks it up per line)."""
    settings = Settings()
    jwt = Credential("test-secret", "jwt", "ey.x.y", "svc-1", "acme", ("m",), expires_at=1_900_000_030.0)
    owner = asyncio.run(owner_of(jwt, MemoryKeyStore(), settings))
    assert owner.signer is not None and owner.signer.kind == "jwt" and owner.signer.expires_at == 1_900_000_030.0
    keys = MemoryKeyStore()
    asyncio.run(keys.save(KeyRecord(key_id="key_acme", tenant="acme", hashes={hash_key(KEYS["acme"]): 0.0})))
    keyed = Credential("test-secret", "key", KEYS["acme"], hash_key(KEYS["acme"]))
    owner = asyncio.run(owner_of(keyed, keys, settings))
    assert owner.signer is not None and owner.signer.kind == "key" and owner.signer.expires_at is None

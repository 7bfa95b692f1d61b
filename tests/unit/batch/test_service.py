"""How a job's lines are signed as its owner (service.signer_for): never past the owner's JWT expiry, so a
token with a second left cannot run a day-long job as its user; keys, looked up by ingest per line, have
no expiry here; and a job recorded before the Signer kept the expiry runs no line as its JWT user."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from pipeline.batch.execute import Executor
from pipeline.batch.records import Batch, Signer, Status
from pipeline.batch.service import signer_for
from pipeline.batch.worker import BatchWorker
from tests.unit.batch.fakes import FakeCompleter
from tests.unit.batch.helpers import Harness, jsonl
from tests.unit.helpers import request
from topics.errors import ErrorCode
from topics.requests import Request

pytestmark = pytest.mark.asyncio
SECRET = "unit-batch-secret"
EXP = 2_000_000_000.0  # the owner's JWT `exp` (plus leeway)
SignFor = Callable[[Batch], Callable[[Request], Request]]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Answering(FakeCompleter):
    """Moves the signer's clock past the JWT's expiry once `at` answers have come back."""

    def __init__(self, clock: Clock, at: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.clock, self.at = clock, at

    async def complete(self, request=None, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return await super().complete(request, **kwargs)
        finally:
            if sum(self.runs.values()) >= self.at:
                self.clock.now = EXP + 1


async def run_job(harness: Harness, batch: Batch, client: FakeCompleter, sign_for: SignFor, clock: Clock | None = None) -> Batch:
    """The job with its owner stored as `batch.signer`, driven to its end by a worker that signs with `sign_for`."""
    await harness.store.update(batch, {Status.validating})

    async def no_wait(_: float) -> None:
        if clock is not None:
            clock.now = max(clock.now, EXP + 1)  # a retry's backoff outlasts the token
        await asyncio.sleep(0)

    def executor_for(job: Batch) -> Executor:
        return Executor(client, sign_for(job), deadline_s=60, max_attempts=2, sleep=no_wait)

    worker = BatchWorker(harness.config, harness.store, harness.files, executor_for, poll_s=0.02)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        for _ in range(500):
            done = await harness.finished(batch.id)
            if done.status is Status.completed:
                return done
            await asyncio.sleep(0.01)
        raise AssertionError(f"batch still {done.status}")
    finally:
        stop.set()
        await task


def refused_as_expired(line: dict) -> bool:
    body = line["response"]["body"]["error"]
    return line["response"]["status_code"] == 401 and body["code"] == ErrorCode.unauthorized and body["message"] == "the token has expired"


async def test_lines_not_sent_before_the_jwt_expires_are_refused_and_the_job_completes(tmp_path: Path) -> None:
    clock = Clock(EXP - 60)
    client = Answering(clock, at=2, fail={"busy": ErrorCode.rate_limited})
    harness = Harness(tmp_path, client, max_in_flight=1)  # one line at a time, in file order
    batch = await harness.submit(jsonl(["a", "busy", "b", "c"]))
    owner = Signer("jwt", "svc-1", "t", (), expires_at=EXP)
    done = await run_job(harness, msgspec.structs.replace(batch, signer=owner), client, signer_for(SECRET, clock), clock)
    assert dict(client.runs) == {"a": 1, "busy": 1}  # "busy"'s retry and the later lines were never sent
    assert [o["custom_id"] for o in harness.lines(done.output_file_id)] == ["c0"]
    errors = harness.lines(done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["c1", "c2", "c3"] and all(refused_as_expired(e) for e in errors)
    assert all(r.principal_token is not None and r.principal_token.kind == "jwt" for r in client.requests)


async def test_a_line_sent_just_before_expiry_carries_a_token_no_longer_than_the_jwt() -> None:
    owner = Signer("jwt", "svc-1", "t", ("m",), expires_at=EXP)
    batch = Batch("batch_" + "0" * 24, "t", "file-" + "0" * 24, "/v1/chat/completions", 0, 0, signer=owner)
    sent = signer_for(SECRET, Clock(EXP - 1))(batch)(request(created_at=EXP - 1, deadline_s=900.0))
    assert sent.principal_token is not None and sent.principal_token.expires_at == EXP
    key = msgspec.structs.replace(batch, signer=Signer("key", "ab" * 32))  # a key: ingest looks it up per line
    sent = signer_for(SECRET, Clock(EXP + 86400))(key)(request(created_at=EXP + 86400, deadline_s=900.0))
    assert sent.principal_token is not None and sent.principal_token.expires_at == EXP + 86400 + 900.0


async def test_a_jwt_job_recorded_before_the_signer_kept_its_expiry_runs_no_line(tmp_path: Path) -> None:
    """Its token's expiry is unknown: the safe reading is expired (it may have had a second left), not
    "never" (the job would act as the user for its whole completion window)."""
    client = FakeCompleter()
    harness = Harness(tmp_path, client)
    batch = await harness.submit(jsonl(["a", "b"]))
    stored = msgspec.to_builtins(msgspec.structs.replace(batch, signer=Signer("jwt", "svc-1", "t")))
    stored["signer"].pop("expires_at", None)  # as an older worker wrote it
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(stored), type=Batch)  # still readable
    done = await run_job(harness, old, client, signer_for(SECRET))
    assert not client.runs and done.output_file_id is None
    assert [refused_as_expired(e) for e in harness.lines(done.error_file_id)] == [True, True]
    assert old.signer is not None and old.signer.expires_at is None

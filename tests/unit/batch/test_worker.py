"""The job lifecycle on the in-memory store: validation errors with line numbers, outputs once per
custom_id, a job that fails every line says so, resume without re-running finished lines, cancel,
expiry, bounded admission, bounded jobs and memory per worker, expired files swept, and two finalizers of
one job at once."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka.errors import MessageSizeTooLargeError

from pipeline.batch.reader import CHUNK_LINES
from pipeline.batch.records import Recorded, Status
from pipeline.batch.validation import Line
from tests.unit.batch.fakes import FakeCompleter
from tests.unit.batch.helpers import CHAT, Harness, jsonl
from topics.errors import ErrorCode

pytestmark = pytest.mark.asyncio


async def run_until(harness: Harness, batch_id: str, statuses: set[Status], **worker: object) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker(**worker).run(stop))  # type: ignore[arg-type]
    try:
        for _ in range(500):
            batch = await harness.store.get(batch_id)
            if batch is not None and batch.status in statuses:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"batch still {batch.status if batch else None}")
    finally:
        stop.set()
        await task


async def test_a_job_runs_every_line_once_and_writes_output_in_line_order(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl([f"q{i}" for i in range(20)]))
    await run_until(harness, batch.id, {Status.completed})
    done = await harness.finished(batch.id)
    assert done.error_file_id is None and done.total == 20 and done.completed_at and done.in_progress_at
    out = harness.lines(done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(20)]
    first = out[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "answer to q0"
    assert first["id"] == "batch_req_" + first["response"]["request_id"]
    assert set(harness.client.runs.values()) == {1}
    assert all(r.priority.value == "batch" for r in harness.client.requests)
    counts = await harness.store.counts(batch.id)
    assert (counts.completed, counts.failed) == (20, 0)
    assert await harness.store.active() == []


async def test_refused_lines_are_in_the_error_file_with_their_line_numbers(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    good = jsonl(["a", "b"])
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    bad = [b"{oops", json.dumps({"custom_id": "c0", "url": CHAT, "body": body}).encode(),
           json.dumps({"custom_id": "u", "url": "/v1/embeddings", "body": body}).encode(),
           json.dumps({"custom_id": "v", "url": CHAT, "body": {"model": "m"}}).encode()]
    batch = await harness.submit(good + b"\n".join(bad) + b"\n")
    await run_until(harness, batch.id, {Status.completed})
    done = await harness.finished(batch.id)
    assert done.total == 6
    errors = harness.lines(done.error_file_id)
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (3, "invalid_json"), (4, "duplicate_custom_id"), (5, "invalid_url"), (6, "invalid_body")]
    assert all(e["response"] is None for e in errors)
    assert [o["custom_id"] for o in harness.lines(done.output_file_id)] == ["c0", "c1"]


async def test_failed_requests_go_to_the_error_file_with_their_status_and_an_all_failed_job_says_so(tmp_path: Path) -> None:
    client = FakeCompleter(fail={"a": ErrorCode.content_filter, "b": ErrorCode.not_found})
    harness = Harness(tmp_path, client)
    batch = await harness.submit(jsonl(["a", "b"]))
    await run_until(harness, batch.id, {Status.completed})
    done = await harness.finished(batch.id)
    assert done.output_file_id is None
    errors = harness.lines(done.error_file_id)
    assert [e["response"]["status_code"] for e in errors] == [400, 404]
    assert errors[0]["response"]["body"]["error"]["code"] == "content_filter"
    assert [e.code for e in done.errors] == ["all_requests_failed"]  # visible on the batch object
    shown = done.to_openai(await harness.store.counts(batch.id))
    assert shown["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert shown["errors"]["data"][0]["code"] == "all_requests_failed"


async def test_a_retriable_failure_is_tried_again_then_recorded(tmp_path: Path) -> None:
    client = FakeCompleter(fail={"busy": ErrorCode.rate_limited})
    harness = Harness(tmp_path, client)
    batch = await harness.submit(jsonl(["busy", "fine"]))
    await run_until(harness, batch.id, {Status.completed})
    assert client.runs["busy"] == 2 and client.runs["fine"] == 1  # max_attempts = 2
    done = await harness.finished(batch.id)
    assert [e["response"]["status_code"] for e in harness.lines(done.error_file_id)] == [429]


async def test_a_restarted_worker_runs_only_the_lines_without_an_outcome(tmp_path: Path) -> None:
    first = FakeCompleter(delay_s=0.005)
    harness = Harness(tmp_path, first, max_in_flight=3)
    batch = await harness.submit(jsonl([f"q{i}" for i in range(40)]))
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    while (await harness.store.counts(batch.id)).completed < 15:
        await asyncio.sleep(0.005)
    stop.set()  # the worker stops mid-job, as a killed one would: its lines in flight are not recorded
    await task
    recorded = await harness.store.recorded_keys(batch.id)
    assert 15 <= len(recorded) < 40
    second = FakeCompleter()
    await run_until(harness, batch.id, {Status.completed}, client=second)
    done = await harness.finished(batch.id)
    out = harness.lines(done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(40)]  # one line per custom_id
    rerun = set(second.runs)
    assert not rerun & {f"q{k[1:]}" for k in recorded}  # nothing finished ran again
    assert len(rerun) == 40 - len(recorded)
    assert sum(first.runs.values()) - len(recorded) <= 3  # what the first left unrecorded was in flight


async def test_an_outcome_recorded_first_wins_and_a_late_one_after_the_end_is_refused(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl(["x", "y"]))
    earlier = Recorded(1, True, b'{"custom_id": "c0", "from": "the worker that was killed"}')
    assert await harness.store.record(batch.id, "c0", earlier)  # its answer landed before it died
    await harness.worker().drive(batch.id, asyncio.Event())
    assert harness.client.runs == {"y": 1}
    assert not await harness.store.record(batch.id, "c1", Recorded(2, True, b"{}"))  # a paused worker, too late
    done = await harness.finished(batch.id)
    out = harness.lines(done.output_file_id)
    assert [o["custom_id"] for o in out] == ["c0", "c1"] and out[0]["from"] == "the worker that was killed"


class HeldAfterFirstPage:
    """The job store as a late finalizer sees it: `results` reads 1000 outcomes at a time, each page what the
    store holds when it is read (as Redis's HSCAN pages do), and waits for `go_on` before its second page."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.first_page_read, self.go_on = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def results(self, batch_id: str) -> list[Recorded]:
        read: list[Recorded] = []
        while page := (await self._store.results(batch_id))[len(read) : len(read) + 1000]:
            read += page
            if not self.first_page_read.is_set():
                self.first_page_read.set()
                await self.go_on.wait()
        return read


async def test_a_late_finalizer_never_writes_part_of_the_outcomes_over_a_finished_jobs_file(tmp_path: Path) -> None:
    """A worker paused past its lease in finalize and the one that took the job over both finalize it: the
    late one reads its first page of outcomes, the other ends the job (and drops them), then the late one
    reads on. Before the fix it wrote its 1000 lines over the complete file (tests/integration/
    test_batch_finalize.py shows the same on Redis)."""
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl(["x"]))
    for line in range(1, 3001):
        assert await harness.store.record(batch.id, f"c{line}", Recorded(line, True, json.dumps({"line": line}).encode()))
    finalizing = msgspec.structs.replace(batch, status=Status.finalizing, total=3000)
    assert await harness.store.update(finalizing, {Status.validating})
    late = harness.worker()
    late.store = held = HeldAfterFirstPage(harness.store)  # type: ignore[assignment]
    reading = asyncio.create_task(late.drive(batch.id, asyncio.Event()))
    await asyncio.wait_for(held.first_page_read.wait(), 5)
    await harness.worker().drive(batch.id, asyncio.Event())  # ends the job and drops its outcomes
    held.go_on.set()
    await asyncio.wait_for(reading, 5)
    done = await harness.finished(batch.id)
    assert done.status is Status.completed
    assert [o["line"] for o in harness.lines(done.output_file_id)] == list(range(1, 3001))


async def held_mid_job(tmp_path: Path, lines: int, in_flight: int) -> tuple[Harness, FakeCompleter, Any, asyncio.Event, asyncio.Task[None]]:
    """A job whose worker runs with `in_flight` lines held at the completer's gate: the harness, the
    completer, the job, the worker's stop event and its task."""
    client = FakeCompleter()
    client.gate = asyncio.Event()
    harness = Harness(tmp_path, client, max_in_flight=in_flight)
    batch = await harness.submit(jsonl([f"q{i}" for i in range(lines)]))
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    while client.in_flight < in_flight:
        await asyncio.sleep(0.005)
    return harness, client, batch, stop, task


async def test_cancel_mid_job_keeps_what_finished_and_reports_the_rest(tmp_path: Path) -> None:
    harness, client, batch, stop, task = await held_mid_job(tmp_path, lines=10, in_flight=2)
    current = await harness.finished(batch.id)
    assert await harness.store.update(msgspec.structs.replace(current, status=Status.cancelling, cancelling_at=1),
                                      {Status.in_progress})
    for _ in range(500):
        if (await harness.finished(batch.id)).status is Status.cancelled:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    done = await harness.finished(batch.id)
    assert done.status is Status.cancelled and done.cancelled_at
    errors = harness.lines(done.error_file_id)
    assert len(errors) == 10 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sum(client.finished.values()) == 0


async def test_an_expired_job_ends_expired_with_the_rest_reported(tmp_path: Path) -> None:
    client = FakeCompleter()
    client.gate = asyncio.Event()
    harness = Harness(tmp_path, client, max_in_flight=1)
    batch = await harness.submit(jsonl(["a", "b"]), expires_in=0)
    await run_until(harness, batch.id, {Status.expired})
    done = await harness.finished(batch.id)
    assert done.expired_at and [e["error"]["code"] for e in harness.lines(done.error_file_id)] == ["batch_expired"] * 2


async def test_admission_bounds_the_lines_in_flight(tmp_path: Path) -> None:
    client = FakeCompleter(delay_s=0.01)
    harness = Harness(tmp_path, client, max_in_flight=3)
    batch = await harness.submit(jsonl([f"q{i}" for i in range(30)]))
    await run_until(harness, batch.id, {Status.completed})
    assert client.most_in_flight == 3


async def test_a_second_worker_does_not_drive_a_leased_job(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl(["a"]))
    assert await harness.store.lease(batch.id, "someone-else", 60)
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    await asyncio.sleep(0.1)
    stop.set()
    await task
    assert (await harness.finished(batch.id)).status is Status.validating and not harness.client.runs


async def test_a_job_whose_input_file_is_gone_fails(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl(["a"]))
    harness.files.delete("t", batch.input_file_id)
    await run_until(harness, batch.id, {Status.failed})
    done = await harness.finished(batch.id)
    assert done.failed_at and done.errors[0].code == "invalid_file"


async def test_a_line_the_broker_refuses_or_the_worker_fails_on_is_that_lines_error_not_the_jobs(tmp_path: Path) -> None:
    client = FakeCompleter(raises={"huge": MessageSizeTooLargeError(), "odd": OverflowError("held too many chunks")})
    harness = Harness(tmp_path, client)
    batch = await harness.submit(jsonl(["a", "huge", "odd", "b"]))
    await run_until(harness, batch.id, {Status.completed})
    done = await harness.finished(batch.id)
    assert [o["custom_id"] for o in harness.lines(done.output_file_id)] == ["c0", "c3"]
    errors = {e["custom_id"]: e["response"] for e in harness.lines(done.error_file_id)}
    assert errors["c1"]["status_code"] == 413 and errors["c2"]["status_code"] == 500
    assert client.runs == {"a": 1, "b": 1}  # each line once: no restart of the job over and over


async def test_an_input_file_deleted_under_a_running_job_fails_it(tmp_path: Path) -> None:
    harness, client, batch, stop, task = await held_mid_job(tmp_path, lines=5, in_flight=1)
    stop.set()  # the worker dies mid-job
    client.gate.set()
    await task
    harness.files.delete("t", batch.input_file_id)
    await run_until(harness, batch.id, {Status.failed, Status.completed})  # the next worker takes it over
    done = await harness.finished(batch.id)
    assert done.status is Status.failed and done.errors[0].code == "invalid_file"


async def test_a_job_whose_input_was_deleted_while_it_ran_still_reports_its_unrun_lines(tmp_path: Path) -> None:
    """The API lets a tenant delete a file a running job reads; the job goes on reading its open handle.
    Each pass had reopened the file, so a cancel after the delete recorded nothing: ten lines, no outcome."""
    harness, client, batch, stop, task = await held_mid_job(tmp_path, lines=10, in_flight=2)
    harness.files.delete(batch.tenant, batch.input_file_id)
    current = await harness.finished(batch.id)
    assert await harness.store.update(msgspec.structs.replace(current, status=Status.cancelling, cancelling_at=1),
                                      {Status.in_progress})
    await run_until(harness, batch.id, {Status.cancelled})
    stop.set()
    await task
    done = await harness.finished(batch.id)
    assert len(harness.lines(done.error_file_id)) == 10


async def test_a_job_cancelled_before_validation_reports_its_refused_lines_too(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    batch = await harness.submit(jsonl(["a", "b"]) + b"{oops\n")
    current = await harness.finished(batch.id)
    assert await harness.store.update(msgspec.structs.replace(current, status=Status.cancelling, cancelling_at=1),
                                      {Status.validating})
    await run_until(harness, batch.id, {Status.cancelled})
    errors = harness.lines((await harness.finished(batch.id)).error_file_id)
    codes = sorted(e["error"]["code"] for e in errors)
    assert codes == ["batch_cancelled", "batch_cancelled", "invalid_json"]  # the refused line was left out


async def test_a_worker_drives_at_most_max_jobs_per_worker_jobs_oldest_first(tmp_path: Path) -> None:
    client = FakeCompleter()
    client.gate = asyncio.Event()
    harness = Harness(tmp_path, client, max_jobs_per_worker=2, max_in_flight=8)
    now = int(time.time())
    ages = [0, 30, 10, 20]  # seconds before now: made newest first, out of order
    jobs = [await harness.submit(jsonl([f"j{i}-a", f"j{i}-b"], prefix=f"j{i}-"), batch_id=f"batch_{now - age:08x}{i:016x}")
            for i, age in enumerate(ages)]
    stop = asyncio.Event()
    task = asyncio.create_task(harness.worker().run(stop))
    while client.in_flight < 4:  # two jobs' lines at the gate
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)  # several scans later: still two
    statuses = {b.id: (await harness.finished(b.id)).status for b in jobs}
    assert [statuses[jobs[i].id] for i in (1, 3)] == [Status.in_progress] * 2  # the oldest two
    assert [statuses[jobs[i].id] for i in (0, 2)] == [Status.validating] * 2  # wait for a later scan
    client.gate.set()
    for _ in range(500):
        if {(await harness.finished(b.id)).status for b in jobs} == {Status.completed}:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    assert {(await harness.finished(b.id)).status for b in jobs} == {Status.completed}


async def test_a_running_job_holds_a_few_of_its_lines_in_memory_not_its_file(tmp_path: Path) -> None:
    _, client, _, stop, task = await held_mid_job(tmp_path, lines=400, in_flight=2)
    gc.collect()
    held = sum(type(o) is Line for o in gc.get_objects())  # not isinstance: it reads __class__, which some objects warn on
    stop.set()
    assert client.gate is not None
    client.gate.set()
    await task
    assert held <= 2 + 1 + CHUNK_LINES, held  # in flight, one waiting for a slot, the rest of the chunk read


async def test_the_worker_sweeps_expired_files_but_not_an_input_an_unfinished_job_reads(tmp_path: Path) -> None:
    day = 24 * 3600
    harness = Harness(tmp_path, upload_keep_s=2 * day, keep_s=3 * day)
    finished = await harness.submit(jsonl(["a"]))
    await run_until(harness, finished.id, {Status.completed})
    output_id = (await harness.finished(finished.id)).output_file_id
    assert output_id is not None
    spare = harness.files.upload("t", "spare.jsonl", io.BytesIO(jsonl(["b"])))
    waiting = await harness.submit(jsonl(["c"]))
    assert await harness.store.lease(waiting.id, "someone-else", 60)  # unfinished, and not this worker's
    output = harness.files.get("t", output_id)
    assert harness.files.expires_at(output) == output.created_at + 3 * day  # with its job's record
    assert harness.files.expires_at(spare) == spare.created_at + 2 * day

    later = time.time() + 2 * day + 60  # the uploads have expired, the output not yet
    await harness.worker(clock=lambda: later).scan(asyncio.Event())
    kept = {f.id for f in harness.files.list("t")[0]}
    assert kept == {output_id, waiting.input_file_id}
    much_later = time.time() + 3 * day + 60
    await harness.worker(clock=lambda: much_later).scan(asyncio.Event())
    assert {f.id for f in harness.files.list("t")[0]} == {waiting.input_file_id}
    assert not harness.files.path(output).exists()

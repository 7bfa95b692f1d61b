"""The batch worker: finds unfinished jobs, leases one at a time per job, and drives each to its end;
at most `max_jobs_per_worker` at once, oldest first (the others wait for a later scan or another worker).

    validating   parse the input file; refused lines are recorded at once (error file, with line numbers);
                 -> in_progress (request_counts.total set), or failed if the file cannot be read
    in_progress  run every line not yet recorded (feeder.py), recording each outcome once (store.record)
                 -> finalizing when all are recorded; the job's expiry -> finalizing (ending: expired)
    cancelling   (set by the API) stop feeding, cancel the lines in flight, record the rest as
                 `batch_cancelled`, finalize -> cancelled
    finalizing   write the output and error files (ids fixed by the batch id) -> completed / expired

Validation and each run read the input file as a stream (reader.py): a job holds a few lines in memory,
never its whole file. Every step is driven by what the store holds, never by what the process remembers,
so any worker can take a job over at any step: a worker that dies loses its lease after `lease_s` and
the next one reads the file again and runs only the lines without an outcome (those in flight at the
crash run again; their first outcome is the one kept). A worker that loses its lease (paused past it) stops feeding;
the outcomes it still records are first-wins like any other, and a finalize it was in writes the same files, or
none once another worker has ended the job (`_finalize` says why that order keeps every file whole).

Every `sweep_s` a scan also deletes the files past their expiry (files.py), except the inputs of
unfinished jobs.

The worker's loops (the scan, each job's lease keeper and cancel watcher) outlive any error but
cancellation: Redis away (`InfraUnavailable`) or refusing (a `ResponseError`: READONLY after a failover,
OOM, BUSY) is logged and tried again after the loop's own wait, so the bridge never silently stops running
jobs, a lease never lapses under a running job and an API cancel is never missed. A job whose stored record
cannot be read (`msgspec.DecodeError`) is logged once and skipped by this worker while it stays active.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from typing import BinaryIO

import msgspec

from pipeline.batch.config import BatchSettings
from pipeline.batch.errors import NotFound
from pipeline.batch.execute import Executor, rejected, unrun
from pipeline.batch.feeder import Admission, feed
from pipeline.batch.files import FileStore
from pipeline.batch.reader import InputLines
from pipeline.batch.records import TERMINAL, Batch, BatchError, Recorded, Status, derived_file_id
from pipeline.batch.store import JobStore
from pipeline.batch.validation import Line, Rejected
from pipeline.errors import InfraUnavailable

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often a worker looks for jobs, and a driven job for a cancellation
RETRY_S = 1.0  # Redis away: wait this long between tries
SWEEP_S = 600.0  # how often a worker deletes expired files


class InputGone(Exception):
    """The job's input file was deleted (or cannot be opened): its lines are unknown now."""


class BatchWorker:
    def __init__(
        self, settings: BatchSettings, store: JobStore, files: FileStore, executor_for: Callable[[Batch], Executor],
        *, owner: str | None = None, clock: Callable[[], float] = time.time, poll_s: float = POLL_S,
        sweep_s: float = SWEEP_S,
    ) -> None:
        self.settings = settings
        self.store = store
        self.files = files
        self.executor_for = executor_for
        self.owner = owner or "worker-" + uuid.uuid4().hex[:12]
        self.admission = Admission(settings.max_in_flight, settings.admission_rps)
        self._clock = clock
        self._poll_s = poll_s
        self._sweep_s = sweep_s
        self._next_sweep = 0.0
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._sources: dict[str, BinaryIO] = {}  # each driven job's input, open for all its passes (`drive`)
        self._unreadable: set[str] = set()  # active jobs whose stored records this worker cannot read: skipped

    async def run(self, stop: asyncio.Event) -> None:
        """Looks for jobs every `poll_s` until `stop` is set; then lets go of its jobs (they move to
        another worker after their lease, or to this one when it starts again)."""
        try:
            while not stop.is_set():
                try:
                    await self.scan(stop)
                except InfraUnavailable as exc:
                    log.warning("batch worker: %s; retrying", exc)
                except Exception as exc:  # a Redis refusal (READONLY, OOM, BUSY) must not end the scans
                    log.warning("batch worker: the scan failed (%s); retrying", _why(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):  # not wait_for: on 3.11 it can swallow a cancel
                        await stop.wait()
        finally:
            for task in self._driving.values():
                task.cancel()
            await asyncio.gather(*self._driving.values(), return_exceptions=True)

    async def scan(self, stop: asyncio.Event) -> None:
        active = await self.store.active()
        self._unreadable.intersection_update(active)  # forget those no longer active
        for batch_id in active:  # oldest first
            if len(self._driving) >= self.settings.max_jobs_per_worker:
                break
            if batch_id in self._driving or batch_id in self._unreadable:
                continue
            if not await self.store.lease(batch_id, self.owner, self.settings.lease_s):
                continue
            task = asyncio.create_task(self._drive_leased(batch_id, stop), name=f"batch {batch_id}")
            self._driving[batch_id] = task
            task.add_done_callback(lambda t, b=batch_id: self._driving.pop(b, None))
        if self._clock() >= self._next_sweep:
            self._next_sweep = self._clock() + self._sweep_s
            await self.sweep(active)

    async def sweep(self, active: list[str]) -> None:
        """Deletes the expired files but the inputs of the unfinished jobs `active`."""
        in_use = set()
        for batch_id in active:
            try:
                batch = await self.store.get(batch_id)
            except msgspec.DecodeError:
                continue  # logged where the job is driven; its input, unknown, is not kept from the sweep
            if batch is not None:
                in_use.add(batch.input_file_id)
        try:
            deleted = await asyncio.to_thread(self.files.sweep, self._clock(), in_use)
        except OSError as exc:  # the next sweep tries again
            log.warning("batch files: the sweep failed: %s", exc)
            return
        if deleted:
            log.info("batch files: %d expired files deleted (%d bytes)", len(deleted), sum(r.bytes for r in deleted))

    async def drive_one(self, batch_id: str, stop: asyncio.Event) -> None:
        """Drives one job (`sluice batch run`): waits for its lease (a run of the same job elsewhere, or
        the lease of one that was killed, runs out after `lease_s`), then drives it to its end or `stop`."""
        while not await self.store.lease(batch_id, self.owner, self.settings.lease_s):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await stop.wait()
            if stop.is_set():
                return
        await self._drive_leased(batch_id, stop)

    async def _drive_leased(self, batch_id: str, stop: asyncio.Event) -> None:
        halt = asyncio.Event()  # the worker stops, or the lease is lost
        keeper = asyncio.create_task(self._keep_lease(batch_id, halt))
        relay = asyncio.create_task(_relay(stop, halt))
        try:
            await self.drive(batch_id, halt)
        except InfraUnavailable as exc:
            log.warning("batch %s: %s; another scan resumes it", batch_id, exc)
        except msgspec.DecodeError as exc:  # tried again it would fail again, every scan
            log.error("batch %s: a stored record cannot be read (%s); this worker skips the job", batch_id, _why(exc))
            self._unreadable.add(batch_id)
        except Exception:
            log.exception("batch %s: the worker failed; another scan resumes it", batch_id)
            await asyncio.sleep(self._poll_s)
        finally:
            for task in (keeper, relay):
                task.cancel()
            await asyncio.gather(keeper, relay, return_exceptions=True)
            with contextlib.suppress(InfraUnavailable):
                await self.store.release(batch_id, self.owner)

    async def _keep_lease(self, batch_id: str, lost: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                held = await self.store.lease(batch_id, self.owner, self.settings.lease_s)
            except InfraUnavailable:
                continue  # the store is away for everyone: nobody else can take it either
            except Exception as exc:  # a refusal (READONLY after a failover): renew at the next turn
                log.warning("batch %s: the lease was not renewed (%s); trying again", batch_id, _why(exc))
                continue
            if not held:
                log.warning("batch %s: lease lost to another worker; stopping here", batch_id)
                lost.set()
                return

    async def drive(self, batch_id: str, stop: asyncio.Event) -> None:
        """One job from its current status to its end (or until `stop`). Every pass over the input reads
        one handle, opened here: a file deleted while the job runs (the API allows it) stays readable to
        the end, so a job cancelled or expired after that still records its unrun lines."""
        batch = await self.store.get(batch_id)
        if batch is None or batch.status in TERMINAL:
            await self.store.deactivate(batch_id, batch.tenant if batch else None)
            return
        try:
            path = self.files.path(self.files.get(batch.tenant, batch.input_file_id))
            self._sources[batch_id] = await asyncio.to_thread(path.open, "rb")
        except (NotFound, OSError):
            pass  # the passes find it gone (InputGone)
        try:
            await self._drive(batch, stop)
        finally:
            if (source := self._sources.pop(batch_id, None)) is not None:
                source.close()

    async def _drive(self, first: Batch, stop: asyncio.Event) -> None:
        batch: Batch | None = first
        if batch.status is Status.validating:
            batch = await self._validate(batch)
        if batch is not None and batch.status is Status.in_progress:
            batch = await self._execute(batch, stop)
        if batch is None:
            return
        if batch.status is Status.cancelling:
            await self._record_unrun(batch, "batch_cancelled", "the batch was cancelled before this line ran")
        if batch.status in (Status.finalizing, Status.cancelling):
            await self._finalize(batch)

    async def _validate(self, batch: Batch) -> Batch | None:
        total = 0
        try:
            async with self._input(batch) as items:
                async for item in items:
                    total += 1
                    if isinstance(item, Rejected):
                        await self.store.record(batch.id, item.key, rejected(batch.id, item))
        except InputGone:
            return await self._fail(batch, "the input file can no longer be read")
        started = msgspec.structs.replace(batch, status=Status.in_progress, in_progress_at=self._now(), total=total)
        if not await self.store.update(started, {Status.validating}):
            return await self.store.get(batch.id)  # cancelled meanwhile: go on from what is stored
        return started

    async def _execute(self, batch: Batch, stop: asyncio.Event) -> Batch | None:
        """Runs every line without an outcome; returns the job as it goes on from here, or None when this
        worker stops (another scan resumes it)."""
        done = await self.store.recorded_keys(batch.id)
        if len(done) < batch.total:
            log.info("batch %s: %d of %d lines to run", batch.id, batch.total - len(done), batch.total)
        executor = self.executor_for(batch)

        async def run(item: Line | Rejected) -> None:  # a refused line here lost its outcome (Redis evicted it)
            outcome = rejected(batch.id, item) if isinstance(item, Rejected) else await executor.run(item)
            await self._record(batch.id, item.key, outcome, stop)

        watcher = asyncio.create_task(self._watch(batch, stop))
        try:
            async with self._input(batch, skip=done) as items:
                finished = await feed(items, run, self.admission, stop)
        except InputGone:  # deleted under a running job
            return await self._fail(batch, "the input file was deleted or can no longer be read while the batch ran")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        current = await self.store.get(batch.id)
        if current is None or current.status is not Status.in_progress:
            return current  # cancelling (or finished by another worker)
        expired = not finished and self._clock() >= batch.expires_at
        if expired:
            await self._record_unrun(current, "batch_expired", "the batch expired before this line ran")
        elif not finished:
            return None
        ending = Status.expired if expired else None
        finalizing = msgspec.structs.replace(current, status=Status.finalizing, finalizing_at=self._now(), ending=ending)
        if not await self.store.update(finalizing, {Status.in_progress}):
            return await self.store.get(batch.id)
        return finalizing

    async def _fail(self, batch: Batch, message: str) -> Batch | None:
        """The job fails (its input file is gone); or, when its status changed meanwhile (cancelled), it goes
        on as stored."""
        error = BatchError("invalid_file", message)
        failed = msgspec.structs.replace(batch, status=Status.failed, failed_at=self._now(), errors=(error,))
        if await self.store.update(failed, {batch.status}):
            await self.store.deactivate(batch.id, batch.tenant)
            return None
        return await self.store.get(batch.id)

    async def _watch(self, batch: Batch, halt: asyncio.Event) -> None:
        """Sets `halt` when the job is cancelled (by the API) or expires: feeding stops, and what the
        store then says decides what follows."""
        while not halt.is_set():
            await asyncio.sleep(self._poll_s)
            if self._clock() >= batch.expires_at:
                halt.set()
                return
            try:
                current = await self.store.get(batch.id)
            except InfraUnavailable:
                continue
            except Exception as exc:  # a refusal, or a record this worker cannot read: look again next turn
                log.warning("batch %s: the status could not be read (%s); trying again", batch.id, _why(exc))
                continue
            if current is None or current.status is not Status.in_progress:
                halt.set()
                return

    async def _record(self, batch_id: str, key: str, outcome: Recorded, stop: asyncio.Event) -> None:
        """Records an outcome, waiting out Redis; given up only when the worker stops (the line runs again)."""
        while True:
            try:
                await self.store.record(batch_id, key, outcome)
                return
            except InfraUnavailable:
                if stop.is_set():
                    raise
                await asyncio.sleep(RETRY_S)

    async def _record_unrun(self, batch: Batch, code: str, message: str) -> None:
        """Records every line without an outcome as not run (`code`), and a refused one as refused (a job
        cancelled before validation ended). Nothing when the file is gone: its lines are unknown."""
        done = await self.store.recorded_keys(batch.id)
        with contextlib.suppress(InputGone):
            async with self._input(batch, skip=done) as items:
                async for item in items:
                    outcome = rejected(batch.id, item) if isinstance(item, Rejected) else unrun(batch.id, item, code, message)
                    await self.store.record(batch.id, item.key, outcome)

    async def _finalize(self, batch: Batch) -> None:
        """Writes the output and error files, then ends the job (compare-and-set on its status).

        Two finalizers can run at once (one paused past its lease, and the worker that took the job over);
        both write the same file ids, so each must write only from a complete read of the outcomes. Once a
        job is finalizing (or cancelling, after `_record_unrun`) every line has its outcome and none changes
        (first-wins). The only thing that removes them is the winner's `forget_results`, which comes after
        its compare-and-set has ended the job. Hence the order here: read the outcomes, then the status. If
        the job has not ended at that read, nothing was removed before it: the read was complete, and the
        files written from it are whole and the same as any other finalizer's (a late rename over the
        winner's file puts the same bytes there). If it has ended, another finalizer wrote the files and
        this one may have read a part (the key deleted between two HSCAN pages): it writes nothing. The files
        are written before the status moves, so a crash at any point leaves the job unfinished (another
        worker finalizes it again) or finished with its files in place.
        """
        results = sorted(await self.store.results(batch.id), key=lambda r: r.line)
        current = await self.store.get(batch.id)
        if current is None or current.status in TERMINAL:  # another worker finished it: its files stand
            log.info("batch %s: finalized by another worker meanwhile; its files stand", batch.id)
            return
        good = [r.text for r in results if r.ok]
        bad = [r.text for r in results if not r.ok]
        output_id = error_id = None
        if good:
            output_id = derived_file_id(batch.id, "output")
            await asyncio.to_thread(self.files.write_output, output_id, batch.tenant, f"{batch.id}_output.jsonl", good)
        if bad:
            error_id = derived_file_id(batch.id, "error")
            await asyncio.to_thread(self.files.write_output, error_id, batch.tenant, f"{batch.id}_error.jsonl", bad)
        errors = batch.errors
        if bad and not good:  # every line failed: say so where a client looks, not only in the error file
            message = f"every one of the {len(bad)} requests failed; their errors are in error_file_id {error_id}"
            errors = (*errors, BatchError("all_requests_failed", message))
        now = self._now()
        if batch.status is Status.cancelling:
            end = msgspec.structs.replace(batch, status=Status.cancelled, cancelled_at=now)
        elif batch.ending is Status.expired:
            end = msgspec.structs.replace(batch, status=Status.expired, expired_at=now)
        else:
            end = msgspec.structs.replace(batch, status=Status.completed, completed_at=now)
        end = msgspec.structs.replace(end, output_file_id=output_id, error_file_id=error_id, errors=errors, ending=None)
        if await self.store.update(end, {batch.status}):
            await self.store.forget_results(batch.id)
            await self.store.deactivate(batch.id, batch.tenant)
            log.info("batch %s: %s, %d lines out, %d with errors", batch.id, end.status.value, len(good), len(bad))

    @contextlib.asynccontextmanager
    async def _input(self, batch: Batch, *, skip: Collection[str] = ()) -> AsyncIterator[InputLines]:
        """The input file's lines but those keyed in `skip`, from the start of the handle `drive` opened;
        InputGone when the file could not be opened (deleted before the job was driven, or unreadable)."""
        source = self._sources.get(batch.id)
        if source is None:
            raise InputGone(batch.input_file_id)
        try:
            await asyncio.to_thread(source.seek, 0)
        except OSError:
            raise InputGone(batch.input_file_id) from None
        yield InputLines(source, batch.endpoint, skip)

    def _now(self) -> int:
        return int(self._clock())


def _why(exc: Exception) -> str:
    """An error as a log line shows it: its type and the start of its message's first line (a Redis
    refusal's reason, a decode error's path), never a stored payload."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:80]}" if lines else type(exc).__name__


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()

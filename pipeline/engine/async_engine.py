"""The engine for asyncio callers: one step loop task per engine, the model in one dedicated thread.

    prefill(request) -> (first token, handle)   run the prompt, sample one token, park the sequence
    decode(handle)   -> async iterator of ids   resume a parked sequence; ids after the first token
    generate(request, handle) -> iterator of ids  prefill and decode in one go (also used to recompute)
    exported(handle) / import_kv(buffer)        move a parked sequence to another engine (process);
                                                export_kv(handle) is `exported` as bytes
    cancel(handle)                              stop a sequence wherever it is (its waiter gets
                                                `SequenceAborted`) and free its blocks
    next_step()                                 returns when the next model step starts (a caller
                                                that checks something once per step)

A handle names a sequence from its start (callers may choose it) until it ends.

Scheduling and bookkeeping run on the event loop; only `ModelRunner.run` runs in the thread, on
inputs snapshotted by `schedule()`, so a cancel during a step is safe (the step's result for that
sequence is discarded). Waiters hear of every token through a per-sequence queue.

An interactive request (a prefill, or a decode that begins) arriving while a step with batch-lane rows
only computes stops that step at its next layer (`ModelRunner.run`; `EngineConfig.interrupt_batch_steps`
may limit this to the first part of a step): on a CPU such a step takes up to half a second with long
batch prompts, and the request would otherwise wait for its end. Nothing of the stopped step is
accounted, so the next step (the interactive request's own, as the batch lane then yields) feeds the
same batch tokens later; the price is the stopped step's work, at most one step per interactive arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pipeline.engine.errors import EngineClosed, SequenceAborted, StepFailed, StepInterrupted, UnknownHandle
from pipeline.engine.kv_store import Buffer
from pipeline.engine.kv_transfer import KVState
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.params import EngineRequest, Priority
from pipeline.engine.sequence import Sequence, SequenceStatus

__all__ = ["AsyncEngine"]

_Item = int | BaseException | None  # a token, an error, or None for "finished"
_T = TypeVar("_T")
IDLE_RECHECK_S = 0.05  # when nothing fits, look again this often even if no wake-up came
ARRIVAL_GAP_S = 0.003  # `gather_arrivals_ms`: a burst has ended when no request arrived for this long


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, name: str = "engine") -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sluice-{name}-model")
        self._handles: dict[str, Sequence] = {}
        self._listeners: dict[int, asyncio.Queue[_Item]] = {}
        self._errors: dict[int, BaseException] = {}  # why a sequence stopped, raised before any queued token
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._staging = asyncio.Lock()  # `exported`: the model runner's staging buffer, one export at a time
        # After an interactive prefill, the batch lane waits up to `handoff_hold_ms` for the sequence's decode
        # to begin (the prefilled message's hop to the decode stage) rather than start a full batch step
        # that the decode would then wait behind; an export (the decode runs elsewhere) or the decode ends it.
        # Holds never add up to more than `handoff_hold_ms` in a row: then one step runs unheld, so a decode
        # stage that lags while prefills keep coming cannot starve the batch lane.
        self._due: dict[int, float] = {}  # interactive parked sequences -> until when the batch lane waits for them
        self._hold_for = engine.scheduler.config.handoff_hold_ms / 1000
        self._held_since: float | None = None
        # Set when interactive work arrives; a batch-only step's model run checks it before its layers
        # (those within `interrupt_batch_steps`: none when that is 0).
        self._arrived = threading.Event()
        self._stepped = asyncio.Event()  # set (and replaced) as each step starts: `next_step`
        self._gather_s = engine.scheduler.config.gather_arrivals_ms / 1000
        self._last_arrival = 0.0

    @property
    def num_active(self) -> int:
        """Sequences waiting or running (parked ones excluded)."""
        return self.engine.scheduler.num_unfinished

    @property
    def num_parked(self) -> int:
        return len(self.engine.scheduler.parked)

    def knows(self, handle: str) -> bool:
        """Whether `handle` names a sequence of this engine still (waiting, running or parked)."""
        return handle in self._handles

    def holds(self, handle: str, token_ids: tuple[int, ...], salt: str) -> bool:
        """Whether `handle` names a parked sequence of exactly these tokens (prompt then completion) and
        this salt (the tenant): a handle from a message must not continue another request's sequence."""
        seq = self._handles.get(handle)
        return (seq is not None and seq.status is SequenceStatus.PARKED and seq.salt == salt
                and tuple(seq.token_ids) == token_ids)

    def is_parked(self, handle: str) -> bool:
        seq = self._handles.get(handle)
        return seq is not None and seq.status is SequenceStatus.PARKED

    async def prefill(self, request: EngineRequest, *, handle: str | None = None) -> tuple[int, str]:
        """Compute the prompt, sample the first token; the sequence waits under the returned handle
        (unless the first token already finished it)."""
        handle = handle or uuid.uuid4().hex
        seq = self._add(request, handle, park=True)
        queue = self._listeners[seq.seq_id]
        try:
            item = await queue.get()
            item = self._errors.pop(seq.seq_id, item)
        except BaseException:
            self._release(handle, seq)
            raise
        finally:
            self._listeners.pop(seq.seq_id, None)
        if isinstance(item, BaseException):
            self._release(handle, seq)
            raise item
        if item is None or seq.status is not SequenceStatus.PARKED:
            self._release(handle, seq)
            if item is None:
                raise SequenceAborted("the sequence ended before its first token")
        return item, handle

    async def decode(self, handle: str) -> AsyncIterator[int]:
        """Tokens after the first, until the sequence finishes; raises `UnknownHandle` if it is gone."""
        seq = self._handles.get(handle)
        if seq is None or seq.status is not SequenceStatus.PARKED:
            raise UnknownHandle(f"no parked sequence under handle {handle[:8]}")
        self._ensure_task()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._listeners[seq.seq_id] = queue
        self.engine.scheduler.unpark(seq)
        self._wake.set()
        self._interactive_arrived(seq)
        async for token in self._drain(handle, seq, queue):
            yield token

    async def generate(self, request: EngineRequest, *, handle: str | None = None) -> AsyncIterator[int]:
        """Every new token of `request` until it finishes (a cancel or a failure raises)."""
        handle = handle or uuid.uuid4().hex
        seq = self._add(request, handle, park=False)
        async for token in self._drain(handle, seq, self._listeners[seq.seq_id]):
            yield token

    @contextlib.asynccontextmanager
    async def exported(self, handle: str) -> AsyncIterator[list[Buffer]]:
        """The parked sequence's state as buffers to write (`KVState.to_buffers`), valid inside the block:
        its K/V lie in the model runner's staging buffer, which one export at a time holds."""
        seq = self._handles.get(handle)
        if seq is None or seq.status is not SequenceStatus.PARKED:
            raise UnknownHandle(f"no parked sequence under handle {handle[:8]}")
        if self._due.pop(seq.seq_id, None) is not None:  # its decode runs elsewhere: the batch lane need not wait
            self._wake.set()
        async with self._staging:
            if seq.status is not SequenceStatus.PARKED:  # cancelled while an earlier export held the buffer
                raise UnknownHandle(f"no parked sequence under handle {handle[:8]}")
            state = await self._in_model_thread(lambda: self.engine.export_kv(seq, staged=True))
            yield state.to_buffers()

    async def export_kv(self, handle: str) -> bytes:
        """`exported` as one byte string."""
        async with self.exported(handle) as parts:
            return b"".join(parts)

    async def import_kv(self, data: Buffer, *, handle: str | None = None, request: EngineRequest | None = None) -> str:
        """Park an exported sequence here (as `request`, when given: `LLMEngine.import_kv`);
        `decode(handle)` continues it. The bytes are parsed off the model thread (their K/V read in
        place); blocks are taken on the event loop (as every allocation is) and only the copy into the
        KV pool runs on it."""
        state = await asyncio.to_thread(KVState.from_buffer, data)
        if self._closed:
            raise EngineClosed("engine is closed")
        seq = self.engine.reserve_import(state, self.engine.check_import(state, request))
        try:
            await self._in_model_thread(lambda: self.engine.runner.write_kv(seq.block_table, state.k, state.v))
        except BaseException:
            self.engine.block_manager.deallocate(seq)
            raise
        self.engine.finish_import(seq)
        self._expect_decode(seq)
        self._wake.set()
        handle = handle or uuid.uuid4().hex
        self._handles[handle] = seq
        return handle

    def cancel(self, handle: str) -> bool:
        """Stop the sequence wherever it is; its waiter (if any) gets `SequenceAborted`. False if gone."""
        seq = self._handles.pop(handle, None)
        if seq is None:
            return False
        self._abort(seq, SequenceAborted(f"sequence {handle[:8]} was cancelled"))
        return True

    async def aclose(self) -> None:
        """Stop the loop; every waiter gets `EngineClosed`."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and self._loop is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(EngineClosed("engine closed"))
        self._executor.shutdown(wait=False)

    def _add(self, request: EngineRequest, handle: str, *, park: bool) -> Sequence:
        if self._closed:
            raise EngineClosed("engine is closed")
        if handle in self._handles:
            raise ValueError(f"handle {handle[:8]} is in use")
        self._ensure_task()
        seq = self.engine.add_request(request, park_after_first=park)
        self._handles[handle] = seq
        self._listeners[seq.seq_id] = asyncio.Queue()
        self._last_arrival = time.monotonic()
        self._wake.set()
        self._interactive_arrived(seq)
        return seq

    async def _gather_arrivals(self) -> None:
        """Woken from idle: wait while requests keep arriving (each within ARRIVAL_GAP_S of the last), at
        most `gather_arrivals_ms`, so a burst starts in one step."""
        deadline = time.monotonic() + self._gather_s
        while (now := time.monotonic()) < deadline and now < self._last_arrival + ARRIVAL_GAP_S:
            await asyncio.sleep(min(self._last_arrival + ARRIVAL_GAP_S, deadline) - now)

    def _interactive_arrived(self, seq: Sequence) -> None:
        if seq.priority is Priority.INTERACTIVE:
            self._arrived.set()

    def _release(self, handle: str, seq: Sequence) -> None:
        if self._handles.get(handle) is seq:
            del self._handles[handle]
        self.engine.abort(seq)
        self._wake.set()

    async def _drain(self, handle: str, seq: Sequence, queue: asyncio.Queue[_Item]) -> AsyncIterator[int]:
        try:
            while True:
                item = await queue.get()
                error = self._errors.pop(seq.seq_id, None)
                if error is not None:
                    raise error
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._listeners.pop(seq.seq_id, None)
            self._errors.pop(seq.seq_id, None)
            self._release(handle, seq)  # a no-op when it finished; frees it when the consumer walked away

    def _abort(self, seq: Sequence, error: BaseException | None = None) -> None:
        self.engine.abort(seq)
        self._wake.set()  # its blocks are free: waiting work may fit now
        queue = self._listeners.get(seq.seq_id)
        if queue is not None and error is not None:
            self._errors[seq.seq_id] = error
            queue.put_nowait(error)

    async def next_step(self) -> None:
        """Returns when the engine's next model step starts: while it computes in the model thread, the
        event loop is free, and anything checked then (Triton's `is_cancelled()`, an IPC round trip per
        request) is checked once per step instead of on a clock."""
        await self._stepped.wait()

    async def _in_model_thread(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _ensure_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="sluice-engine-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.engine.scheduler
        idle = True  # nothing to do since the last step (or ever): the next arrivals may be a burst
        while True:
            if not scheduler.num_unfinished:
                idle = True
                self._wake.clear()
                await self._wake.wait()
                continue
            if idle and self._gather_s:
                await self._gather_arrivals()
            idle = False
            hold = self._hold_s()
            self._arrived.clear()  # whatever arrived so far, this schedule sees
            output = scheduler.schedule(hold_batch=hold > 0)
            self._forget(output.dropped)
            if output.is_empty:  # nothing fits yet, or a decode is due: wait for a wake-up (a release, a decode)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                    async with asyncio.timeout(min(hold, IDLE_RECHECK_S) if hold else IDLE_RECHECK_S):
                        await self._wake.wait()
                continue
            batch_only = not any(c.seq.priority is Priority.INTERACTIVE for c in output.chunks)
            interrupt = self._arrived if batch_only else None
            self._stepped.set()
            self._stepped = asyncio.Event()
            try:
                sampled = await loop.run_in_executor(self._executor, self.engine.execute, output, interrupt)
            except StepInterrupted:  # an interactive request arrived: the next schedule takes it first
                self.engine.interrupted_steps += 1
                continue
            except Exception as exc:  # the model failed: fail this step's sequences, keep serving
                error = StepFailed(f"model step failed: {exc!r}")
                error.__cause__ = exc
                for chunk in output.chunks:
                    self._abort(chunk.seq, error)
                continue
            for seq in scheduler.update_from_output(output, sampled):
                self._expect_decode(seq)
                queue = self._listeners.get(seq.seq_id)
                if queue is None:
                    continue
                for token in seq.token_ids[len(seq.token_ids) - seq.num_new_tokens :]:  # 1..k+1 with speculation
                    queue.put_nowait(token)
                if seq.is_done:
                    queue.put_nowait(None)

    def _expect_decode(self, seq: Sequence) -> None:
        if self._hold_for and seq.status is SequenceStatus.PARKED and seq.priority is Priority.INTERACTIVE:
            self._due[seq.seq_id] = time.monotonic() + self._hold_for

    def _hold_s(self) -> float:
        """How long the batch lane should still wait for a due decode (0: not at all)."""
        if not self._due:
            self._held_since = None
            return 0.0
        now, parked = time.monotonic(), self.engine.scheduler.parked
        for seq_id, until in list(self._due.items()):
            if until <= now or seq_id not in parked:  # its decode began, it left, or the wait is over
                del self._due[seq_id]
        hold = max(self._due.values(), default=now) - now
        if hold <= 0:
            self._held_since = None
            return 0.0
        if self._held_since is None:
            self._held_since = now
        if now - self._held_since >= self._hold_for:  # held long enough in a row: this step runs unheld
            self._held_since = None
            return 0.0
        return min(hold, self._held_since + self._hold_for - now)

    def _forget(self, dropped: tuple[Sequence, ...]) -> None:
        if dropped:
            gone = {s.seq_id for s in dropped}
            for handle in [h for h, s in self._handles.items() if s.seq_id in gone]:
                del self._handles[handle]

    def _fail_all(self, error: BaseException) -> None:
        for seq in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
            self._abort(seq, error)
        for queue in self._listeners.values():
            queue.put_nowait(error)

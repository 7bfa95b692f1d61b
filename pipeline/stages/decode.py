"""decode: the generation phase, for one pool. Streams numbered chunks until a stop token, a stop string
or `max_tokens`, then exactly one terminal event; stops within a step when `llm.control` cancels.
Tokens produced close together go as one chunk (`pipeline.stages.coalesce`): a non-streaming answer
from a fast backend is a single chunk message.

The stream survives its worker. Each chunk, once the broker acknowledged it, is recorded in the state
store with the tokens consumed so far and the characters sent (`Progress`), under this worker's
ownership. A worker that takes a request over (a crash, a rebalance, a redelivery) takes ownership
first, then continues from the recorded progress: the backend re-prefills prompt + tokens and samples
what the first worker would have sampled (seeded per request and position), so the client sees one
seamless stream and only the chunks in flight at the crash are decoded twice (emit drops them). A
worker that finds it no longer owns the request (it was paused past its session and replaced, or the
request was redelivered to another) stops and lets the runner try the message again later: whoever
then owns the partition takes the request back and finishes it, so a message is never committed by a
worker that gave it up. A worker that meets a finished request sends its recorded ending again (emit
drops the repeat) instead of generating. The ending is recorded only after the broker acknowledged it,
that is after every chunk before it: recording it earlier would let a retry skip chunks whose delivery
had failed (the chaos suite's broker outage found exactly that).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from functools import partial

import msgspec

from pipeline.backends.base import Delta, SplitBackend
from pipeline.backends.base import Prefilled as BackendPrefilled
from pipeline.backends.errors import BackendError, Cancelled
from pipeline.errors import InfraUnavailable
from pipeline.routing.reroute import rerouted
from pipeline.routing.stats import BackendStats
from pipeline.settings import BackendSettings
from pipeline.stage import Out, Stopwatch, address_of
from pipeline.stages.coalesce import STREAM_WINDOW_S, coalesced
from pipeline.stages.generation import CANCEL_CODE, Cancellations, generation_request
from pipeline.state import StateStore
from pipeline.topology import Topics
from topics import codec, registry
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import Prefilled, client_id_of
from topics.stream import EMPTY_DIGEST, Done, Failed, FinishReason, StreamEvent, Usage, digest_step

log = logging.getLogger(__name__)
AHEAD = 16  # chunks a stream may run ahead of its last acknowledged one: a broker that stops acknowledging
# stops generation there, instead of the rest of the answer being generated into a void and again later
AHEAD_WAIT_S = 40.0  # a backstop for acknowledgements that neither come nor fail (a refused chunk: `_refuse`)


class Progress(msgspec.Struct, frozen=True):
    """How far a request's stream got: what a successor resumes from."""

    tokens: tuple[int, ...]  # completion tokens consumed (the first token included)
    sent_chars: int  # characters of their text sent in chunks
    next_seq: int  # the next chunk's number
    digest: str  # the hash chain of the texts sent (topics.stream.digest_step)


_progress = msgspec.msgpack.Decoder(Progress)


class DecodeStage:
    input_type: type = Prefilled
    ordered = False
    phase = "decode"  # in error messages

    reroutes = False  # decode continues prefill's stream: there is no "before the first chunk" to reroute

    def __init__(
        self, backend: SplitBackend, topics: Topics, store: StateStore, name: str = "decode",
        stats: BackendStats | None = None, backends: Mapping[str, BackendSettings] | None = None,
        chunk_window_s: float = STREAM_WINDOW_S,
    ) -> None:
        self.name, self.topics = name, topics
        self._window_s = chunk_window_s  # tokens within it go as one chunk (0: a chunk per token)
        self.stats = stats  # what this worker reports of its backend on llm.backend.health
        self._backends = backends or {}  # every configured backend by name: where a fallback's pool is
        self._backend = backend
        self._store = store
        self._owner = f"{name}:{uuid.uuid4().hex[:12]}"  # this worker, for this process's life
        # Cancellations seen, kept a while: one may arrive before its request reaches decode.
        self._cancelled = Cancellations()
        self._active: set[str] = set()
        # The three marks below stop a running try of a request. Only that try's callbacks set them
        # (`_current`), and `handle` clears them when the try ends: they never hold more ids than run.
        self._fenced: set[str] = set()  # another worker owns the request now: stop, the runner retries later
        self._unrecorded: set[str] = set()  # progress could not be written (Redis away): stop, retry later
        self._refused: set[str] = set()  # the broker failed to take a chunk: stop, the runner retries later
        self._acked: dict[str, tuple[int, asyncio.Event]] = {}  # rid -> (next seq recorded, set on each record)
        self._counting: set[str] = set()  # requests counted as started in `stats`, not yet as ended

    async def aclose(self) -> None:
        await self._store.aclose()

    async def on_control(self, message: Cancel) -> None:
        """Every decode worker hears every cancellation: it stops the request if it runs it, and records
        it (in the store when the id is the pipeline's, so a worker that starts later knows too). Only for
        a request ingest admitted (its state exists): anyone who may write llm.control could otherwise
        fill Redis with a key an hour per made-up id, pushing out live requests' state."""
        self._cancelled.heard(message)
        for rid in [r for r in self._active if message.id in (r, client_id_of(r))]:
            await self._backend.cancel(rid)  # first: a store write that fails (Redis away) must not keep it running
        if "/" in message.id:
            await self._store.amend(message.id, {"cancel": message.reason.value.encode()})

    def _cancel_reason(self, rid: str, stored: dict[str, bytes]) -> CancelReason | None:
        if (raw := stored.get("cancel")) is not None:
            return CancelReason(raw.decode())
        return self._cancelled.reason(rid)

    async def handle(self, message: Prefilled) -> AsyncIterator[Out]:
        rid = message.id
        if rid in self._active:  # a second message for a stream this worker is generating (prefill ran twice)
            return  # the running one finishes it; its own message stays uncommitted until it has
        self._active.add(rid)
        try:
            stored = await self._store.take(rid, self._owner)
            if (ended := stored.get("finished")) is not None:  # decided already: send that ending again (emit drops it)
                yield Out(self.topics.stream or "", rid, codec.decode(ended, StreamEvent))
                return
            async for out in self._generate(message, stored):
                yield out
        finally:
            if rid in self._counting and self.stats is not None:  # left before `_ended` counted an outcome
                self._counting.discard(rid)
                self.stats.abandoned()
            self._active.discard(rid)
            self._fenced.discard(rid)
            self._unrecorded.discard(rid)
            self._refused.discard(rid)
            self._acked.pop(rid, None)

    def _first(self, message: Prefilled) -> Progress:
        """The progress before any chunk of this stage: prefill's first token, sent as chunk 0."""
        prefill = message.prefill
        sent_first = bool(prefill.first_text)  # prefill sent it as chunk 0
        return Progress((prefill.first_token_id,), len(prefill.first_text), int(sent_first),
                        digest_step(EMPTY_DIGEST, prefill.first_text) if sent_first else EMPTY_DIGEST)

    def _deltas(self, message: Prefilled, progress: Progress, resumed: bool) -> AsyncIterator[Delta]:
        """The backend's stream after `progress`: decode from prefill's KV handle (recomputed if it is gone)."""
        prefill = message.prefill
        generation = generation_request(message.request, message.id, progress.tokens[:-1], progress.sent_chars if resumed else None)
        handoff = BackendPrefilled(prefill.handle, progress.tokens[-1], prefill.first_text, prefill.prompt_tokens, None)
        return self._backend.decode(generation, handoff)

    def _usage(self, message: Prefilled, progress: Progress, reported: Delta | None) -> Usage:
        return Usage(message.prefill.prompt_tokens, len(progress.tokens))

    async def _generate(self, message: Prefilled, stored: dict[str, bytes]) -> AsyncIterator[Out]:
        """The stream from where the store says it got to (`_first` when it says nothing)."""
        clock = Stopwatch()
        rid = message.id
        address = address_of(message)
        assert address is not None
        progress = _progress.decode(stored["progress"]) if "progress" in stored else self._first(message)
        held = asyncio.Event()  # this try's: set on each recorded acknowledgement and on a refusal
        self._acked[rid] = (progress.next_seq, held)
        refused = partial(self._refuse, rid, held)
        timings = lambda: {**message.timings, self.name: clock.ms()}  # noqa: E731
        last: Delta | None = None  # the backend's last delta (its token counts, when it reports them)
        usage = lambda p: self._usage(message, p, last)  # noqa: E731
        if (reason := self._cancel_reason(rid, stored)) is not None:
            text = "cancelled before decode started"
            yield self._terminal(rid, progress, address.failed(CANCEL_CODE[reason], text, chunks=progress.next_seq, usage=usage(progress), timings=timings()))
            return
        error: tuple[ErrorCode, str] | None = None
        retry_after: float | None = None  # an upstream's retry-after, passed on to the client
        finish = FinishReason.length
        pending: tuple[int, ...] = ()  # tokens consumed since the last chunk (their text held back)
        failure: BackendError | None = None
        if self.stats is not None:
            self.stats.started()
            self._counting.add(rid)
        try:
            deltas = _until(self._deltas(message, progress, "progress" in stored), address.deadline)
            chunks = coalesced(deltas, streaming=message.request.stream, first_alone=progress.next_seq == 0, window_s=self._window_s)
            async with aclosing(deltas), aclosing(chunks) as stream:  # closed in reverse: the merging first
                async for delta in stream:
                    self._check_still_recording(rid)
                    last = delta
                    pending += delta.token_ids
                    if delta.text:
                        await self._wait_for_acks(rid, progress.next_seq)
                        progress = self._advance(progress, pending, delta)
                        chunk = address.chunk(progress.next_seq - 1, delta.text, pending)
                        if chunk.seq == 0 and self.stats is not None:
                            self.stats.first_token(clock.ms())
                        # the backend's last delta: its terminal event follows at once, in the same batch,
                        # and records this chunk's progress with the ending (one round trip fewer)
                        ends = delta.finish_reason is not None
                        yield Out(self.topics.stream or "", rid, chunk, acked=None if ends else self._record(rid, progress, held),
                                  with_next=ends, refused=refused)
                        pending = ()
                    elif pending:
                        progress = msgspec.structs.replace(progress, tokens=progress.tokens + pending)
                        pending = ()
                    if delta.finish_reason is not None:
                        finish = FinishReason(delta.finish_reason)
                    elif time.time() > address.deadline:
                        error = (ErrorCode.deadline_exceeded, "the request's deadline passed during generation")
                        break
        except _DeadlinePassed:
            error = (ErrorCode.deadline_exceeded, "the request's deadline passed during generation")
        except Cancelled:
            reason = self._cancelled.reason(rid) or CancelReason.client_gone
            error = (CANCEL_CODE[reason], f"generation stopped: {reason.value}")
        except BackendError as exc:
            error = (exc.code, f"backend failed during {self.phase} ({type(exc).__name__})")
            retry_after = getattr(exc, "retry_after_s", None)
            failure = exc
        for out in self._ended(message, failure, sent=progress.next_seq, answered=error is None):
            if out.topic != registry.HEALTH:  # sent on to a fallback backend: its terminal is the fallback's
                await self._still_owner(rid)  # unless a successor serves it: two pools would answer one request
                yield out
                return
            yield out
        if error is not None:
            await self._still_owner(rid)
            yield self._terminal(rid, progress, address.failed(*error, chunks=progress.next_seq, usage=usage(progress),
                                                     timings=timings(), retry_after_s=retry_after))
            return
        yield self._terminal(rid, progress, address.done(chunks=progress.next_seq, digest=progress.digest, finish=finish,
                                               usage=usage(progress), timings=timings()))

    def _ended(self, message: Prefilled, failure: BackendError | None, sent: int, answered: bool) -> list[Out]:
        """Counts how the backend did (a health report at once when a failure streak reaches the ejection
        threshold) and, where the stage may, sends a request its backend failed before any chunk on to the
        next fallback backend (`reroutes`). Only an answer ends a failure streak: a cancellation, a
        deadline or a request the backend refused as invalid says nothing of its health (an upstream that
        stalls until every client gives up would otherwise never be ejected)."""
        outs: list[Out] = []
        retriable = failure is not None and failure.retriable
        self._counting.discard(message.id)
        if self.stats is not None:
            if not (retriable or answered):
                self.stats.abandoned()
            elif self.stats.finished(failed=retriable):
                outs.append(Out(registry.HEALTH, self.stats.key, self.stats.report()))
        if retriable and self.reroutes and sent == 0 and (onward := rerouted(message, self._backends)) is not None:
            outs.append(onward)
        return outs

    def report(self) -> list[Out]:
        return [Out(registry.HEALTH, self.stats.key, self.stats.report())] if self.stats is not None else []

    async def _wait_for_acks(self, rid: str, seq: int) -> None:
        """Holds chunk `seq` back while AHEAD chunks before it wait for the broker."""
        recorded, event = self._acked.get(rid, (seq, asyncio.Event()))
        while seq - recorded >= AHEAD:
            self._check_still_recording(rid)  # a refusal or a takeover wakes the wait: checked before each
            event.clear()
            try:
                async with asyncio.timeout(AHEAD_WAIT_S):  # not wait_for: 3.11's can swallow a revoke's cancel
                    await event.wait()
            except TimeoutError:
                raise InfraUnavailable("the broker has not acknowledged this stream's chunks") from None
            recorded, event = self._acked.get(rid, (seq, event))
        self._check_still_recording(rid)

    async def _still_owner(self, rid: str) -> None:
        """Before an error ending or a reroute: a worker paused past its session and taken over learns it
        only from the records after its next acknowledgements, and one that resumes to find its backend's
        stream broken would end, with an error, a stream its successor is serving, or send the request to
        a fallback pool that then serves it beside the successor (two answers interleaved under one id).
        One fenced no-op (position 0 never moves the recorded one) asks the store; errors are rare, so
        that round trip is too."""
        self._check_still_recording(rid)
        if not await self._store.advance(rid, "next_seq", 0, {}, owner=self._owner):
            self._fenced.add(rid)
            raise InfraUnavailable("taken over by another decode worker")

    def _check_still_recording(self, rid: str) -> None:
        """Stops a stream whose progress another worker has taken over, or that cannot be recorded: the
        runner tries the message again later (resuming), so whoever owns the partition finishes it."""
        if rid in self._fenced:
            raise InfraUnavailable("taken over by another decode worker")
        if rid in self._unrecorded:
            raise InfraUnavailable("decode progress cannot be recorded")
        if rid in self._refused:
            raise InfraUnavailable("the broker did not take this stream's chunks")

    def _refuse(self, rid: str, held: asyncio.Event) -> None:
        """A chunk of this try was not taken (its batch expired in an outage, or its producer was
        refused). The runner records acknowledgements in order and none after a failed one, so this try
        can record nothing more: the stream stops at its next chunk (the runner tries the message again,
        resuming from what was recorded), not `AHEAD_WAIT_S` after it ran AHEAD chunks past the refusal
        on a renewed producer (the 60 s broker outage's 41-43 s recovery tail). A refusal from an
        earlier try of the request changes nothing."""
        if self._current(rid, held):
            self._refused.add(rid)
            held.set()

    def _current(self, rid: str, held: asyncio.Event) -> bool:
        """Whether the try that `held` belongs to still runs: its acknowledgements and refusals may stop
        it. Those of a try that ended (the runner awaits the last ones after `handle` returned, and a
        revoke leaves them running) or of an earlier try must not mark the request: `handle` cleared the
        marks already, so the id would stay (one per stream in flight at each takeover or Redis outage)
        until a later try of it on this worker stopped on the stale mark at once."""
        return (waiting := self._acked.get(rid)) is not None and waiting[1] is held

    @staticmethod
    def _advance(progress: Progress, tokens: tuple[int, ...], delta: Delta) -> Progress:
        return Progress(progress.tokens + tokens, progress.sent_chars + len(delta.text), progress.next_seq + 1,
                        digest_step(progress.digest, delta.text))

    def _record(self, rid: str, progress: Progress, held: asyncio.Event):  # type: ignore[no-untyped-def]
        """After the broker acknowledged a chunk: record how far the stream got, if this worker still owns it.
        Never backwards (`StateStore.advance` on the chunk count): acknowledgements can be recorded out of
        order (a later chunk's, or a try's from before a reset), and an earlier one written last made a
        successor decode the chunks after it again. What it learns stops only its own try (`_current`)."""
        encoded = msgspec.msgpack.encode(progress)

        async def acked() -> None:
            try:
                recorded = await self._store.advance(
                    rid, "next_seq", progress.next_seq, {"progress": encoded}, owner=self._owner
                )
            except InfraUnavailable:
                if self._current(rid, held):
                    self._unrecorded.add(rid)
                raise
            finally:
                if self._current(rid, held):  # wake the stream if it is held back on its acks
                    recorded_seq, _ = self._acked[rid]
                    self._acked[rid] = (max(recorded_seq, progress.next_seq), held)
                    held.set()
            if not recorded:
                log.info("stage=%s request=%s taken over by another worker; stopping", self.name, rid)
                if self._current(rid, held):
                    self._fenced.add(rid)

        return acked

    def _terminal(self, rid: str, progress: Progress, event: Done | Failed) -> Out:
        """The request's ending. Once the broker acknowledged it (and so every chunk before it), it is
        recorded, so a worker that meets the request later sends this ending again (emit drops the
        repeat) instead of generating; only while this worker owns the request. The same call records
        `progress` unless a later one is (the last chunk, which goes in the ending's batch, records
        nothing itself). The ending is recorded without its cache ticket (over a kilobyte with a semantic
        tier's embedding, kept for the state TTL against a memory-capped Redis): it is recorded only once
        the original, ticket included, was acknowledged, so a replay comes after it on the request's
        partition, which emit reads in order, and emit stores the answer from the original or not at all
        (a replay meets a finished request). Were a replay ever to reach emit first, the cost would be
        one cache entry not stored."""
        encoded = codec.encode(msgspec.structs.replace(event, ticket=None) if isinstance(event, Done) else event)
        recorded = msgspec.msgpack.encode(progress)

        async def acked() -> None:
            if not await self._store.advance(rid, "next_seq", progress.next_seq, {"progress": recorded},
                                             owner=self._owner, always={"finished": encoded}):
                raise InfraUnavailable("taken over by another decode worker")

        return Out(self.topics.stream or "", rid, event, acked=acked)


class _DeadlinePassed(Exception):
    """The request's deadline passed while the backend had sent nothing (`_until`)."""


class _Deadline:
    """One timer per stream that cancels the task waiting on the backend once the deadline passes
    (`asyncio.timeout_at` around each wait cost 8 us a delta, more than the instant backend's step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self.passed = False
        self.waiting: asyncio.Task[object] | None = None  # set only while the task waits on the backend
        self.cancelled: asyncio.Task[object] | None = None  # the task this timer cancelled
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.passed = True
        if self.waiting is not None:
            self.cancelled = self.waiting
            self.waiting.cancel()

    def close(self) -> None:
        self._timer.cancel()


async def _until(deltas: AsyncIterator[Delta], deadline: float) -> AsyncIterator[Delta]:
    """`deltas` until the request's `deadline` (epoch seconds, as `Address.deadline`), then
    `_DeadlinePassed`. The check after each delta in `_generate` cannot end a backend that sends none
    (an upstream that sends only keep-alive comments held a request 10 s past a 2 s deadline, to end
    `client_gone`). Only a wait on the backend is cancelled, never a yield: cancelling the task while it
    runs the consumer would cancel whatever the consumer awaits."""
    loop = asyncio.get_running_loop()
    bound = _Deadline(loop, loop.time() + (deadline - time.time()))  # the loop's clock, not the wall clock
    try:
        while not bound.passed:
            task = bound.waiting = asyncio.current_task()
            try:
                delta = await anext(deltas)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if bound.cancelled is task and task is not None and task.uncancel() == 0:  # ours alone
                    raise _DeadlinePassed() from None
                raise
            finally:
                bound.waiting = None
            yield delta
        raise _DeadlinePassed()
    finally:
        bound.close()
        await deltas.aclose()  # type: ignore[attr-defined]

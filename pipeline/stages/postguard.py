"""postguard: checks the answer as it streams, holding back the newest `holdback_tokens` chunks
(at least 64 characters, and an entity-shaped run such as a card number from its start: stream_check.py),
so nothing flagged reaches the client. Output PII is redacted by policy (pattern recognisers; `block`
entities end the stream); toxicity, the regex blocklist and, on a route that names its topics, an
answer that leaves them (reason `off_topic`) end it. Ending a stream is the kill
switch: postguard releases the text before the flagged span, publishes `Cancel(output_guard)` on
`llm.control` (decode stops within a step), drops any chunk still arriving, and turns decode's
terminal event into a `content_filter` error carrying decode's usage and timings.

Chunks are renumbered (redaction and cuts change them), and the terminal event carries the count and
digest of what was released. The per-request window survives the worker: it is written to the state
store before each chunk's outputs are produced, with the released chunks not yet acknowledged
(postguard_state.py), so a successor restores it, sends those again (emit drops what the client has)
and goes on. The window has an owner, as decode's and emit's records do: the first time a worker meets
a stream it takes the window over, and it writes only while it still owns it. A worker paused past its
session and replaced finds its write refused when it resumes; the message is tried again from the
store's window, so a stale window never overwrites its successor's (one that did could leave a third
worker waiting for input chunks whose messages were already finished). Only when the store has no
window for a stream met midway (expired) does the request end with a retriable `internal` error rather
than a stream with a hole.

A refusal under a client's bare id (`Failed.nonce`: ingest's) passes straight on: it has no chunks to
check or hold, and emit keeps one ending per refused record. Kept here by id, like a stream's ending,
every refusal after the first under one id was dropped as a redelivery (and, after a restart, the
first one's stored ending sent in its place): the client waited until its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from pipeline.errors import InfraUnavailable
from pipeline.guard.config import GuardSettings
from pipeline.guard.entities import Action
from pipeline.guard.errors import Reason
from pipeline.guard.stream_check import OutputGuard, StreamState
from pipeline.sequencing import Sequencer
from pipeline.stage import Out, address_of
from pipeline.stages import postguard_state
from pipeline.state import MemoryStateStore, StateStore
from pipeline.topology import Topics
from topics import codec
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, StreamEvent, digest_step

_REMEMBER = 100_000  # finished requests kept to drop late events, oldest forgotten first
ACK_WAIT_S = 10.0  # a backstop for acknowledgements of released chunks that neither come nor fail
GuardPolicy = Mapping[str, Action]


@dataclass
class _Stream:
    check: StreamState
    order: Sequencer = field(default_factory=Sequencer)  # input chunks back in order, once each
    next_out: int = 0  # the seq of the next released chunk
    digest: str = EMPTY_DIGEST  # the hash chain of the released texts
    spent_s: float = 0.0  # time spent in this stage on the request, over all its chunks
    killed: Reason | None = None  # set when the kill switch fired; decode's terminal event is awaited
    unacked: dict[int, str] = field(default_factory=dict)  # released, not yet acknowledged: seq -> text
    received: str = EMPTY_DIGEST  # the hash chain of the input texts taken in order ("": not known)
    moved: asyncio.Event | None = None  # set when a released chunk is acknowledged or refused (`_acknowledged`)
    lost: bool = False  # a released chunk was refused by the broker: its message is tried again

    def window(self) -> bytes:
        return postguard_state.encode(postguard_state.window_of(
            self.check, next_in=self.order.next_seq, next_out=self.next_out, digest=self.digest,
            unacked=self.unacked, killed=self.killed, held={c.seq: c.text for c in self.order.held()},
            received=self.received))

    @classmethod
    def restored(cls, raw: bytes, policy: GuardPolicy, message: StreamEvent) -> _Stream:
        w = postguard_state.decode(raw)
        order = Sequencer(w.next_in)
        for seq, text in w.held.items():  # all above next_in: held again behind the same gap
            order.accept(Chunk(id=message.id, reply_to=message.reply_to, seq=seq, text=text, tenant=message.tenant, model=message.model))
        return cls(postguard_state.restore_check(w, policy), order, w.next_out, w.digest,
                   killed=w.killed, unacked=dict(w.unacked), received=w.received)


class PostguardStage:
    input_type = StreamEvent
    ordered = True  # a request's chunks are checked in order

    def __init__(
        self, settings: GuardSettings, guard: OutputGuard, topics: Topics, store: StateStore | None = None,
        name: str = "postguard",
    ) -> None:
        self.name, self.topics = name, topics
        self._settings = settings
        self._guard = guard
        self._store = store if store is not None else MemoryStateStore()
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # request -> its lock, and how many hold or await it
        self._owner = f"{name}:{uuid.uuid4().hex[:12]}"

    async def aclose(self) -> None:
        await self._store.aclose()

    async def reset(self, request_id: str | None) -> None:
        """Forget cached windows (one request, or all): the store has them."""
        if request_id is None:
            self._streams.clear()
            self._finished.clear()
        else:  # a message of it is tried again: from the store's window (and its ending, if it has one)
            self._streams.pop(request_id, None)
            self._finished.pop(request_id, None)

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        if isinstance(message, Failed) and message.nonce is not None:  # a bare-id refusal: nothing to keep
            yield Out(self.topics.forward or "", message.id, message)
            return
        async with self._one_at_a_time(message.id):
            outs = await self._step(message, time.perf_counter())
        for out in outs:
            yield out

    async def _step(self, message: StreamEvent, started: float) -> list[Out]:
        """Checks one event and writes the window it leaves; returns what to send. Called for one request
        at a time: a message tried again after a reset (the broker or Redis away) and the next message of
        the same request, handled meanwhile, each read the window, and the older one's write could land
        last (the guarded full chaos profile's broker outage, session 28: the next chunk then waited for
        good for one whose message was done)."""
        rid = message.id
        if rid in self._finished:
            return []  # decode's own ending after the kill switch, or a redelivery
        resend: list[Out] = []
        if rid not in self._streams:
            resend, ended = await self._restore(message)
            if ended:
                return resend
        before = self._streams.get(rid)
        if before is not None and not resend and not isinstance(message, Chunk):
            await self._acknowledged(before)
        outs = list(self._handle(message, started))
        stream = self._streams.get(rid) or before  # `_handle` forgets a stream it ended
        record: dict[str, bytes] = {}
        if stream is not None:  # before anything is sent: with the chunks released but not yet acknowledged
            record[postguard_state.FIELD] = stream.window()
        if (terminal := next((o.value for o in outs if isinstance(o.value, Done | Failed)), None)) is not None:
            record[postguard_state.ENDED] = codec.encode(_as_recorded(terminal))
        if record and not await self._store.write(_key(rid), record, owner=self._owner):
            raise InfraUnavailable("taken over by another postguard worker")  # tried again after a reset
        return resend + outs

    @staticmethod
    async def _acknowledged(stream: _Stream) -> None:
        """Before decode's ending: every chunk that earlier messages released is acknowledged. The runner
        holds a terminal event back only behind its own message's outputs, and the next message of a
        partition starts once the previous one's are queued: a chunk still pending on a producer that a
        broker outage then replaces would fail after this ending went out on the new one, and its retry
        would reach emit behind it (`stream_incomplete` for a whole answer). Normally the last chunk's
        acknowledgement is a millisecond or two away."""
        deadline = time.monotonic() + ACK_WAIT_S
        while stream.unacked:
            if stream.lost:
                raise InfraUnavailable("a chunk released before this ending was not taken by the broker")
            stream.moved = asyncio.Event()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):  # not wait_for: see runner.py
                    await stream.moved.wait()
            except TimeoutError:
                raise InfraUnavailable("chunks released before this ending are not acknowledged") from None

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, rid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(rid) or (asyncio.Lock(), 0)  # a lock made only when none is held
        self._locks[rid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[rid]
            if users == 1:
                del self._locks[rid]
            else:
                self._locks[rid] = (lock, users - 1)

    async def _restore(self, message: StreamEvent) -> tuple[list[Out], bool]:
        """A predecessor's window for this stream, if the store has one: what it must send again (released
        chunks not acknowledged, the kill switch, the ending) and whether the stream had already ended."""
        rid = message.id
        stored = await self._store.take(_key(rid), self._owner)
        resend: list[Out] = []
        if (raw := stored.get(postguard_state.FIELD)) is not None:
            stream = self._streams[rid] = _Stream.restored(raw, self._settings.policy(message.tenant or "default"), message)
            stream.check.topics = self._guard.watch(message.model)  # restarts: the released sentences are not kept
            resend = [self._released(message, seq, text, stream) for seq, text in sorted(stream.unacked.items())]
            if stream.killed is not None:
                resend.append(Out(self.topics.control, rid, Cancel(id=rid, reason=CancelReason.output_guard, at=time.time())))
        if (ended := stored.get(postguard_state.ENDED)) is not None:  # a redelivery after the end
            self._finish(rid)
            return [*resend, Out(self.topics.forward or "", rid, codec.decode(ended, StreamEvent))], True
        return resend, False

    def _released(self, message: StreamEvent, seq: int, text: str, stream: _Stream, *, with_next: bool = False) -> Out:
        """A released chunk, forgotten from the window once the broker acknowledged it. `with_next`: the
        request's ending follows it (what the window held back, released at the end): the two go as one
        record batch, the ending not waiting for the chunk's acknowledgement."""
        async def acked() -> None:
            stream.unacked.pop(seq, None)
            if stream.moved is not None:
                stream.moved.set()

        def refused() -> None:
            stream.lost = True
            if stream.moved is not None:
                stream.moved.set()

        chunk = Chunk(id=message.id, reply_to=message.reply_to, seq=seq, text=text, tenant=message.tenant, model=message.model)
        return Out(self.topics.forward or "", message.id, chunk, acked=acked, with_next=with_next, refused=refused)

    def _handle(self, message: StreamEvent, started: float) -> Iterator[Out]:
        rid = message.id
        stream = self._streams.get(rid)
        if stream is None:
            if isinstance(message, Chunk) and message.seq > 0:
                self._finish(rid)
                text = "the output guard lost this stream's state (a worker restarted); retry the request"
                address = address_of(message)
                assert address is not None
                yield Out(self.topics.forward or "", rid, address.failed(ErrorCode.internal, text))
                return
            check = StreamState(self._settings.policy(message.tenant or "default"), topics=self._guard.watch(message.model))
            stream = self._streams[rid] = _Stream(check)
            if len(self._streams) > _REMEMBER:
                self._streams.popitem(last=False)
        if stream.killed is not None:  # after the kill switch: drop chunks, turn decode's ending into ours
            if not isinstance(message, Chunk):
                yield Out(self.topics.forward or "", rid, self._ended(message, stream, stream.killed, started))
            return
        if isinstance(message, Chunk):
            taken = stream.order.accept(message)
            for c in taken:
                stream.received = digest_step(stream.received, c.text) if stream.received else ""
            steps = [self._guard.push(stream.check, c.text) for c in taken]
        else:
            steps = [self._guard.finish(stream.check)]
        for step in steps:
            if step.release:
                stream.digest = digest_step(stream.digest, step.release)
                stream.unacked[stream.next_out] = step.release
                yield self._released(message, stream.next_out, step.release, stream, with_next=not isinstance(message, Chunk))
                stream.next_out += 1
            if step.violation is not None and isinstance(message, Chunk):
                # The kill switch: decode stops within a step and sends its terminal event, which becomes
                # the content_filter error (with decode's usage and timings) when it arrives here.
                stream.killed = step.violation
                stream.spent_s += time.perf_counter() - started
                yield Out(self.topics.control, rid, Cancel(id=rid, reason=CancelReason.output_guard, at=time.time()))
                return
        if not isinstance(message, Chunk):
            yield Out(self.topics.forward or "", rid, self._ended(message, stream, steps[0].violation, started))
        else:
            stream.spent_s += time.perf_counter() - started

    def _ended(self, message: Done | Failed, stream: _Stream, violation: Reason | None, started: float) -> Done | Failed:
        """The request's one terminal event, with what this stage released and the time it spent."""
        self._finish(message.id)
        ms = round((stream.spent_s + time.perf_counter() - started) * 1000.0, 3)
        timings = {**message.timings, self.name: ms}
        address = address_of(message)
        assert address is not None
        if violation is not None:
            text = f"{violation}: the output guard stopped this answer"
            return address.failed(ErrorCode.content_filter, text, chunks=stream.next_out, usage=message.usage, timings=timings)
        if stream.order.gap() or message.chunks > stream.order.next_seq:  # chunks of the answer never arrived
            text = f"chunks {stream.order.next_seq}..{message.chunks - 1} of this answer were lost; retry the request"
            return address.failed(ErrorCode.stream_incomplete, text, chunks=stream.next_out, usage=message.usage, timings=timings)
        if isinstance(message, Done) and stream.received and message.digest != stream.received:
            # what came in is not what decode sent: two attempts' chunks, cut differently, under the same seqs
            text = "the chunks of this answer that reached the output guard differ from the ones generated; retry the request"
            return address.failed(ErrorCode.stream_incomplete, text, chunks=stream.next_out, usage=message.usage, timings=timings)
        if isinstance(message, Done):
            return msgspec.structs.replace(message, chunks=stream.next_out, digest=stream.digest, timings=timings)
        return msgspec.structs.replace(message, chunks=stream.next_out, timings=timings)

    def _finish(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._finished[rid] = None
        if len(self._finished) > _REMEMBER:
            self._finished.popitem(last=False)


def _as_recorded(terminal: Done | Failed) -> Done | Failed:
    """The ending as the store keeps it (`postguard_end`), for `state.ttl_s`: without a cache ticket, whose
    embedding (768 bytes, more as JSON) made it about 1.7 KB a request against 0.4. Only a redelivery
    after the end reads it (`_restore`), and sends it on: emit drops it if it recorded the request's ending,
    and otherwise (this worker died between this write and the send) delivers it without the ticket, so
    that one answer is not stored in the cache. A miss later, nothing the client sees."""
    if isinstance(terminal, Done) and terminal.ticket is not None:
        return msgspec.structs.replace(terminal, ticket=None)
    return terminal


def _key(rid: str) -> str:
    """postguard's record of a stream: its own key, so its ownership is independent of decode's."""
    return rid + "#postguard"

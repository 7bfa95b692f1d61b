"""emit: the only writer of reply topics. Forwards each chunk once and in order (held back behind a
gap until it fills), writes exactly one terminal event per request with the stage timings, and one
usage record per finished request.

What it already sent survives it: after the broker acknowledges a chunk, the next expected seq and the
digest chain are recorded in the state store; the terminal event marks the request finished. A
successor (a crash, a rebalance) takes ownership of the request's emit record the first time it meets
it and reads them, so it neither repeats a chunk nor a terminal event beyond the ones in flight at the
crash (which the SDK drops by seq). A chunk that arrives early (held until the gap before it fills)
is stored before its message is finished, since the broker will not deliver that message again.
Positions are written one at a time per request and never backwards. A worker that finds its record
taken (it was paused past its session and replaced) stops forwarding that request and lets the runner
try the message again: the worker that owns the partition then takes the record back and goes on from
what it says. The usage record is claimed in the store before it is produced, so billing sees it at
most once. A refusal under a client's bare id is kept per refused record, not per id
(`stage.state_id`): the same id refused again (sent again after a 429) gets its own terminal event, a
replay of the refused record does not. A terminal event the runner sent for a request itself (past its
deadline in an outage, or dead-lettered) is one of emit's: recorded when the store answers, never
followed by another.

A finished answer (`Done`, stop or length, every chunk seen by this worker from the first) whose
request carries a cache ticket is stored: in the exact tier (Redis) and, when the request had a semantic
tier (its ticket carries an embedding), as an entry on `llm.cache.entries` for every cache worker's
semantic index. Errors, cancellations, `content_filter` endings, answers over `cache.max_entry_bytes`
and streams this worker took over midway are not. Nor is an answer whose ticket is not the request's own
to write (`_may_store`): `Ticket.key` comes off a topic, and was written to Redis as it came, so a crafted
or buggy `Done` could set any key (a spend counter, an API key record) or plant an answer in another
tenant's cache; a key must lie in the request's tenant and model scope (`keys.scope`) and its TTL within
`cache.config.MAX_TTL_S`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec

from pipeline.cache import keys
from pipeline.cache.config import MAX_TTL_S
from pipeline.cache.exact import ExactTier
from pipeline.errors import InfraUnavailable, Undeliverable
from pipeline.observability import costs
from pipeline.sequencing import Sequencer
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch, address_of, state_id
from pipeline.state import MemoryStateStore, StateStore
from pipeline.topology import Topics
from topics import codec
from topics.cache import Entry, Ticket
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, StreamEvent, Usage, digest_step
from topics.usage import UsageRecord

log = logging.getLogger(__name__)

# requests in flight whose progress this worker keeps in memory (the store has all of them); a request
# leaves as soon as its terminal event and every chunk before it are recorded (`_retire`)
_CACHED = 50_000
# A worker that confirmed its ownership of a request this recently (its `take`, or a fenced write that
# went through) sends the terminal event without asking again. Another worker can only take the request
# after this one's partition was reassigned, which needs seconds of silence from it (a pause, a stall):
# any such stall shows in the elapsed time, and then the check is made.
OWNERSHIP_FRESH_S = 0.005
# Requests retired with their terminal event recorded (`_retire`), still known to have ended (`has_ended`):
# the runner asks about one whose message failed just after its ending, or met an outage past its deadline.
# Fewer than `_CACHED`: an id is all each one keeps, and the question comes within the request's deadline.
_ENDED = 10_000
ACK_ORDER_WAIT_S = 40.0  # how long a chunk's record waits for the one before it: longer than the producer's
# request timeout (30 s), by which the earlier chunk's produce has gone through or failed (and been reset)


class Meter(Protocol):
    """Told of every terminal event once it is sent: charges tokens and spend (the gateway)."""

    async def finish(self, event: Done | Failed) -> None: ...

    async def aclose(self) -> None: ...


class _Sent:
    """What the client has of one request: in-order position, digest chain, whether it has ended."""

    __slots__ = ("order", "digest", "finished", "ended", "fenced", "stored", "writing", "advanced", "dropped", "texts", "size",
                 "confirmed")

    def __init__(self, next_seq: int, digest: str, finished: bool) -> None:
        self.order = Sequencer(next_seq)
        self.texts: list[str] | None = [] if next_seq == 0 else None  # the whole answer, for the cache
        self.size = 0
        self.digest = digest
        self.finished = finished
        self.ended = False  # its terminal event is recorded in the store
        self.fenced = False  # another emit worker took this request over
        self.stored = next_seq  # the position as the store has it: it only moves forward
        self.writing = asyncio.Lock()  # acknowledgements of successive messages arrive together
        self.advanced = asyncio.Event()  # set (and replaced) each time `stored` moves, or when dropped
        self.dropped = False  # forgotten by a reset: the store is the truth again, waiters give up
        self.confirmed = float("-inf")  # when the last call that proved this worker the owner began (monotonic)

    def owned_since(self, started: float) -> None:
        """A call begun at `started` found this worker the owner."""
        self.confirmed = max(self.confirmed, started)

    def advance(self, position: int) -> None:
        self.stored = max(self.stored, position)
        self.advanced.set()
        self.advanced = asyncio.Event()

    def drop(self) -> None:
        self.dropped = True
        self.advanced.set()


class EmitStage:
    input_type = StreamEvent
    ordered = True  # chunks of one request must leave in the order they arrived
    # Consecutive records of one request are handled together (pipeline/runner.py `_groups`): handling a
    # chunk is quick and in memory, so a request's last chunk can wait for its ending and leave with it.
    groups = True

    def __init__(
        self, settings: Settings, topics: Topics, store: StateStore | None = None, meter: Meter | None = None,
        name: str = "emit", answers: ExactTier | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.topics = name, topics
        self._replies = settings.reply_topics
        self._cache = settings.cache
        self._answers = answers  # the cache's exact tier, written when an answer may be stored
        self._store = store if store is not None else MemoryStateStore()
        self._meter = meter
        self._prices = settings.gateway.prices
        self._models = frozenset(settings.models)
        self._tenant_label = costs.TenantLabels(frozenset((*settings.gateway.tenants, settings.gateway.anonymous_tenant,
                                                           *settings.observability.tenant_labels)))
        self._sent: OrderedDict[str, _Sent] = OrderedDict()
        # Chunks held behind a gap, carried over to the request's next message: a predecessor's, read from
        # the store, or this worker's when a reset dropped its progress. Bounded like `_sent`: a retry that
        # reaches its deadline never takes its entry; the store keeps every held chunk (`_hold`), and a
        # request whose progress is read again reads them again.
        self._carried: OrderedDict[str, list[Chunk]] = OrderedDict()
        # Requests a message of which is being retried (its produce or its acknowledged write failed: the
        # broker or Redis was away), so a gap in them may be a chunk still on its way, not a lost one
        # (`_wait_for_retries`), each with the position whose record ends the doubt: the furthest this worker
        # had forwarded when it failed (several messages may be in retry; the first one's record is not enough).
        # Bounded like `_sent`: a retry that reaches its deadline never clears its entry.
        self._unsure: OrderedDict[str, int] = OrderedDict()
        # Requests whose terminal event the broker acknowledged (`Out.delivered`, or the runner's own,
        # `note_ended`) and whose record of it was not written (Redis was away; it or a record before it
        # failed): the retried message records it instead of sending it again. What the broker has is not
        # undone by a reset, so this outlives resets; bounded like `_sent`.
        self._delivered: OrderedDict[str, None] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()  # see _ENDED
        self._owner = f"{name}:{uuid.uuid4().hex[:12]}"
        self._clock = clock  # monotonic: how long ago ownership was confirmed

    async def aclose(self) -> None:
        if self._meter is not None:
            await self._meter.aclose()
        if self._answers is not None:
            await self._answers.aclose()
        await self._store.aclose()

    async def reset(self, request_id: str | None) -> None:
        """Forget cached progress (one request, or all): the store, written after acks, is the truth."""
        if request_id is None:
            for sent in self._sent.values():
                sent.drop()
            self._sent.clear()
            self._carried.clear()
            self._unsure.clear()  # every message in flight is redelivered after a rebalance
        else:  # handling.py, before it tries a message of this request again: its chunks may still come
            sent = self._sent.pop(request_id, None)  # (a produce that failed in a broker outage never reached `acked`)
            self._mark_unsure(request_id, sent.order.next_seq if sent is not None else 0)
            if sent is not None:
                sent.drop()
                if held := sent.order.held():
                    self._carry(request_id, held)  # their messages may be done: keep them, they are the client's

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        clock = Stopwatch()
        if message.reply_to not in self._replies:
            raise Undeliverable("reply_to is not a configured reply topic")
        rid = state_id(message)  # the request's id, or a bare-id refusal's own (its record's nonce)
        sent = await self._progress(rid)
        if sent.fenced:  # another worker took this request over: this message is tried again after a reset
            raise InfraUnavailable("taken over by another emit worker")
        carried = self._carried.pop(rid, [])
        if sent.finished and not isinstance(message, Chunk):
            return  # a redelivery after the terminal event (the client has it)
        # A chunk of a finished request goes out again unless its position was recorded: the terminal
        # event does not wait for the chunks' records, so it can overtake a chunk whose produce then
        # failed (pending on a producer that was replaced in a broker outage). The client waits for such
        # a chunk after the terminal event (`pipeline/sdk.py`); a chunk it already has is dropped by seq.
        ready = [c for held in carried for c in sent.order.accept(held)]
        if isinstance(message, Chunk):
            ready += sent.order.accept(message)
            if sent.order.holds(message.seq):  # its offset will be committed: only the store keeps it now
                await self._hold(rid, sent, message)
        for chunk in ready:
            sent.digest = digest_step(sent.digest, chunk.text)
            self._keep(sent, chunk.text)
            yield Out(message.reply_to, rid, chunk, acked=self._write(rid, sent, {"digest": sent.digest.encode()}, chunk.seq + 1))
        if isinstance(message, Chunk):
            return
        await self._still_ours(rid, sent)
        self._wait_for_retries(rid, message, sent)
        # The terminal event does not wait for the records of the chunks before it: that wait held the
        # partition's next messages behind every request's last acknowledgement (+8 ms p50 end to end at
        # 50 requests/s). A chunk whose produce is still pending on a producer that is then replaced can
        # be overtaken by this event on the new one: its retry is sent after it (above), and the client
        # waits for it.
        sent.finished = True
        self._unsure.pop(rid, None)
        terminal = self._terminal(message, sent, clock)
        terminal = costs.priced(terminal, self._prices, self._billed(terminal).usage)
        if rid in self._delivered:  # an earlier try's terminal event is on the reply topic: only record it
            await self._write(rid, sent, {"terminal": b"1"})()
        else:
            costs.observe(terminal, self._tenant_label(terminal.tenant), self._models)
            yield Out(message.reply_to, message.id, terminal, acked=self._write(rid, sent, {"terminal": b"1"}),
                      delivered=lambda: self._note_delivered(rid))
        if await self._store.claim(rid, "usage", b"1"):
            yield Out(self.topics.usage, terminal.tenant or "anonymous", self._usage(terminal))
        if self._meter is not None:
            await self._meter.finish(self._billed(terminal))
        texts, sent.texts = sent.texts, None
        ticket = message.ticket if isinstance(message, Done) else None
        if (isinstance(terminal, Done) and ticket is not None and texts is not None and self.topics.table
                and self._may_store(terminal, ticket)):
            entry = self._entry(terminal, ticket, texts)
            if self._answers is not None:
                await self._answers.put(entry)
            if ticket.vector:  # none when the request had no semantic tier: every cache worker skips such an entry
                yield Out(self.topics.table, entry.key, entry)

    async def _still_ours(self, rid: str, sent: _Sent) -> None:
        """Raises InfraUnavailable when another worker took the request over (a paused worker's was taken).
        Asks the store unless this worker's ownership was confirmed within OWNERSHIP_FRESH_S: a request
        whose last chunk and ending come in one group was just taken, and asking again would add a Redis
        round trip to every answer without narrowing the window that the check leaves anyway (between
        its reply and the send)."""
        started = self._clock()
        if started - sent.confirmed < OWNERSHIP_FRESH_S:
            return
        if not await self._store.write(_key(rid), {}, owner=self._owner):
            sent.fenced = True
            raise InfraUnavailable("taken over by another emit worker")
        sent.owned_since(started)

    def _keep(self, sent: _Sent, text: str) -> None:
        """Collects the answer as the client gets it, while it fits in a cache entry."""
        if sent.texts is None:
            return
        sent.size += len(text.encode())
        if sent.size > self._cache.max_entry_bytes:
            sent.texts = None
        else:
            sent.texts.append(text)

    @staticmethod
    def _may_store(done: Done, ticket: Ticket) -> bool:
        """Whether the ticket is the request's own: its key in the tenant and model's scope, its TTL in
        (0, MAX_TTL_S]. Logged, the key as a digest only, when it is not (a bug, or a forged `Done`)."""
        if ticket.key.startswith(keys.scope(done.tenant, done.model)) and 0 < ticket.ttl_s <= MAX_TTL_S:
            return True
        log.warning("cache: request %s not stored: its ticket (key %s, ttl_s %s) is not its tenant and model's",
                    done.id, hashlib.sha256(ticket.key.encode()).hexdigest()[:12], ticket.ttl_s)
        return False

    def _entry(self, done: Done, ticket: Ticket, texts: list[str]) -> Entry:
        now = time.time()
        return Entry(
            key=ticket.key, tenant=done.tenant, model=done.model, context=ticket.context, chunks=tuple(texts),
            finish_reason=done.finish_reason.value, prompt_tokens=done.usage.prompt_tokens,
            completion_tokens=done.usage.completion_tokens, stored_at=now, expires_at=now + ticket.ttl_s,
            vector=ticket.vector, salient=ticket.salient,
        )

    def _billed(self, terminal: Done | Failed) -> Done | Failed:
        """What the meter charges: a cache hit costs no tokens unless the config bills hits in full."""
        if isinstance(terminal, Done) and terminal.cache is not None and self._cache.hit_billing == "none":
            return msgspec.structs.replace(terminal, usage=Usage())
        return terminal

    async def _progress(self, rid: str) -> _Sent:
        sent = self._sent.get(rid)
        if sent is None:
            started = self._clock()
            fields = await self._store.take(_key(rid), self._owner)
            if (sent := self._sent.get(rid)) is not None:  # another message of the request restored it meanwhile
                self._sent.move_to_end(rid)  # and may have gone on from it: what it restored is the progress
                return sent
            digest = fields.get("digest", EMPTY_DIGEST.encode()).decode()
            sent = self._sent[rid] = _Sent(int(fields.get("emitted", b"0")), digest, "terminal" in fields)
            sent.owned_since(started)
            stored = [codec.decode(raw, Chunk) for name, raw in fields.items() if name.startswith(_HELD)]
            if stored:  # what a predecessor held behind a gap: accepted before the message at hand
                self._carry(rid, sorted(stored + self._carried.get(rid, []), key=lambda c: c.seq))
            if len(self._sent) > _CACHED:
                self._sent.popitem(last=False)[1].drop()
        self._sent.move_to_end(rid)
        return sent

    def _carry(self, rid: str, chunks: list[Chunk]) -> None:
        self._carried[rid] = chunks
        self._carried.move_to_end(rid)
        if len(self._carried) > _CACHED:
            self._carried.popitem(last=False)

    def _mark_unsure(self, rid: str, upto: int) -> None:
        self._unsure[rid] = max(self._unsure.get(rid, 0), upto)
        if len(self._unsure) > _CACHED:
            self._unsure.popitem(last=False)

    def _wait_for_retries(self, rid: str, message: Done | Failed, sent: _Sent) -> None:
        """A terminal event that finds chunks missing while an earlier message of its request is being
        retried (its produce or acknowledged write failed: the broker or Redis was away) waits for that retry: the
        request's later messages do not wait for it, and ending now would call a late chunk lost."""
        upto = self._unsure.get(rid)
        if upto is not None and upto <= sent.stored:  # all it had forwarded is recorded: no retry of it is owed
            del self._unsure[rid]  # (this very message's failure marked it: it waited for good, and its partition)
            return
        if upto is not None and (sent.order.gap() or message.chunks > sent.order.next_seq):
            raise InfraUnavailable("an earlier message of this request is being retried; its chunks may still come")

    def _terminal(self, message: Done | Failed, sent: _Sent, clock: Stopwatch) -> Done | Failed:
        """The event the client gets: the chunk count and digest of what it received, or
        `stream_incomplete` when chunks are missing (a gap, or fewer than the stream claims) or what it
        received is not what the stream's writer sent: the digest chains differ when a retry after a
        failed send cut its chunks otherwise than the attempt whose chunks did land (docs/reliability.md),
        and the client must not take that text for the answer."""
        now = time.time()
        total = round((now - message.created_at) * 1000.0, 3) if message.created_at else 0.0
        timings = {**message.timings, self.name: clock.ms(), "total": total}
        received = sent.order.next_seq
        text = None
        if sent.order.gap() or message.chunks > received:
            text = f"chunks {received}..{message.chunks - 1} of this answer were lost; retry the request"
        elif isinstance(message, Done) and message.digest != sent.digest:
            text = "the chunks of this answer that reached you differ from the ones generated; retry the request"
        if text is not None:
            address = address_of(message)
            assert address is not None
            return address.failed(ErrorCode.stream_incomplete, text, chunks=received, usage=message.usage, timings=timings)
        if isinstance(message, Done):
            return msgspec.structs.replace(message, chunks=received, digest=sent.digest, timings=timings, ticket=None)
        return msgspec.structs.replace(message, chunks=received, timings=timings)

    def _usage(self, message: Done | Failed) -> UsageRecord:
        """The request's usage record. A refusal's model is the one the client sent, any string (ingest may
        have refused it as unknown): the record names it only if it is configured, else "other", as the
        metrics do, so a client can neither mint usage rows nor put control characters in `sluice usage`."""
        outcome = "done" if isinstance(message, Done) else message.code.value
        model = message.model if isinstance(message, Done) or message.model in self._models else costs.OTHER
        now = time.time()
        total = round((now - message.created_at) * 1000.0, 3) if message.created_at else 0.0
        return UsageRecord(
            id=message.id, tenant=message.tenant, model=model, outcome=outcome,
            prompt_tokens=message.usage.prompt_tokens, completion_tokens=message.usage.completion_tokens,
            total_ms=total, timings=message.timings, at=now, cost=message.cost,
            cache=message.cache.value if isinstance(message, Done) and message.cache is not None else None,
        )

    async def _hold(self, rid: str, sent: _Sent, chunk: Chunk) -> None:
        """Stores a chunk held behind a gap before its message is finished (and its offset committed)."""
        started = self._clock()
        if not await self._store.write(_key(rid), {f"{_HELD}{chunk.seq}": codec.encode(chunk)}, owner=self._owner):
            sent.fenced = True
            raise InfraUnavailable("taken over by another emit worker")
        sent.owned_since(started)

    async def _recorded(self, sent: _Sent, position: int) -> None:
        """Waits until the store holds `position`, that is until every chunk before it was acknowledged and
        recorded. InfraUnavailable (the message is tried again) when the request's progress was dropped (a
        message of it is being retried: its chunk may not have reached the client) or the wait runs out."""
        deadline = time.monotonic() + ACK_ORDER_WAIT_S
        while sent.stored < position:
            if sent.dropped:
                raise InfraUnavailable("an earlier chunk of this request is being sent again")
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):  # not wait_for: see runner.py
                    await sent.advanced.wait()
            except TimeoutError:
                raise InfraUnavailable("an earlier chunk of this request was not acknowledged") from None

    def _write(self, rid: str, sent: _Sent, fields: dict[str, bytes], position: int = 0) -> Callable[[], Awaitable[None]]:
        """Records `fields` once the broker acknowledged the output. Writes of one request go one at a
        time and a position is never written over a later one: the acknowledgements of successive
        messages arrive together, and two writes in flight could land in either order. A position is
        recorded only after the one before it: the acknowledgements of two messages are independent, and
        in a broker outage chunk k's produce can fail while chunk k + 1's, sent later on a renewed producer,
        goes through; recording k + 2 then would make the retry of chunk k look like a repeat, and the
        client would never get it (seen once in the chaos suite's outage: a Done whose stream had a hole).
        And the store never takes a position back (`StateStore.advance`): after a reset, the acknowledgements
        of the request's earlier tries still arrive, each recorded through the progress it was made with,
        and one of them once wrote position 37 over 39 while chunk 38's message was already finished; the
        terminal event then waited for chunk 38 for good, and the partition behind it (seen in the chaos
        suite's Redis restart)."""
        async def acked() -> None:
            if position:
                await self._recorded(sent, position - 1)
            async with sent.writing:
                if position and position <= sent.stored or "terminal" in fields and sent.ended:
                    return
                # The terminal event already acknowledged (it went in this chunk's batch): recorded with the
                # position, and its own write finds it done (one round trip fewer per request)
                ending = {"terminal": b"1"} if position and rid in self._delivered else None
                started = self._clock()
                try:
                    if position:  # the store keeps the furthest position: a late write of an earlier one is dropped
                        written = await self._store.advance(_key(rid), "emitted", position, fields, owner=self._owner, always=ending)
                    else:
                        written = await self._store.write(_key(rid), fields, owner=self._owner)
                except BaseException:
                    self._mark_unsure(rid, sent.order.next_seq)  # this message is retried; its chunks may come again
                    raise
                if not written:
                    sent.fenced = True  # the runner tries the message again, after `reset`: re-read the store
                    raise InfraUnavailable("taken over by another emit worker")
                sent.owned_since(started)
                sent.advance(position)
                if position and position >= self._unsure.get(rid, position + 1):
                    del self._unsure[rid]  # every chunk forwarded before the failure is recorded now
                if "terminal" in fields or ending:
                    sent.ended = sent.finished = True  # (an ending the runner sent: no message of it had finished it)
                    self._delivered.pop(rid, None)
                self._retire(rid, sent)

        return acked

    def has_ended(self, state_id: str) -> bool:
        """Whether this worker knows the request's terminal event is on the reply topic (`stage.Ending`):
        the broker acknowledged it, recorded or not yet."""
        sent = self._sent.get(state_id)
        return state_id in self._delivered or state_id in self._retired or (sent is not None and sent.ended)

    def note_ended(self, state_id: str) -> None:
        """The runner put the request's terminal event on the reply topic itself (`stage.Ending`: one of
        its messages waited out an outage past the deadline, or was dead-lettered). Taken as one of emit's
        own that the broker acknowledged: the request's next ending (decode's sent again, its own deadline
        ending) only records it once the store answers, and is not sent (it was: two terminal events)."""
        self._note_delivered(state_id)

    def _note_delivered(self, rid: str) -> None:
        """The broker acknowledged this request's terminal event (forgotten once it is recorded)."""
        self._delivered[rid] = None
        if len(self._delivered) > _CACHED:
            self._delivered.popitem(last=False)

    def _retire(self, rid: str, sent: _Sent) -> None:
        """Forgets a request whose terminal event and every chunk before it are recorded: the store answers
        a late redelivery as well (its terminal event is not sent twice, a recorded chunk is not repeated).
        Kept until then, finished requests stayed until 50,000 more had passed, each with its lock, event
        and sequencer: 1.6 KB and five objects for the garbage collector per request, 80 MB at the bound
        (seen growing in a long benchmark run). Its id stays a while in `_retired` (`has_ended`)."""
        if sent.ended and sent.stored >= sent.order.next_seq and self._sent.get(rid) is sent:
            del self._sent[rid]
            self._retired[rid] = None  # still ended: `has_ended` says so, not only while in `_sent`
            if len(self._retired) > _ENDED:
                self._retired.popitem(last=False)


_HELD = "held:"  # field prefix of a chunk held behind a gap: "held:<seq>" -> the encoded chunk


def _key(rid: str) -> str:
    """emit's record of a request: its own key, so its ownership is independent of decode's."""
    return rid + "#emit"

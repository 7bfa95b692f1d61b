"""What a stage is: a named, pure async handler from one decoded message to the messages to send.

A stage imports no Kafka client. The runner (`pipeline.runner`) consumes `input_topics` with the
consumer group `name`, decodes each payload as `input_type`, calls `handle`, produces what it yields,
and commits only after every produce is acknowledged. A stage gets its topics from the graph
(`pipeline.topology.Topics`); it names none itself.

Capabilities beyond `handle` are declared protocols the runner checks with isinstance:
`Controlled` (hears every cancellation), `Tabled` (reads a compacted topic whole), `Reporting`
(publishes on a clock), `Ending` (knows whose terminal event it put out), `Resettable` (keeps
per-request caches in front of its state store), `Closable` (has connections of its own to close).
A stage keeps a request's state under `Address.state_id`: its id, or for a refusal under a client's
bare id, that one refusal (`Failed.nonce`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec

from pipeline.topology import Topics
from topics.cache import Ticket
from topics.errors import ErrorCode, retriable
from topics.hops import Admitted
from topics.requests import Request
from topics.stream import Chunk, Done, Failed, FinishReason, RateLimit, Usage


@dataclass(frozen=True)
class Out:
    """One message to produce. `key` is the request id, so a request's messages keep their order.
    `acked`, if set, is awaited once the broker has acknowledged this message (in yield order): a stage
    records progress there, so what it records was really sent. `with_next`: the stage yields the next
    output at once (the last chunk of an answer, then its terminal event) and the two may travel as one
    record batch, which the broker appends whole or not at all: the runner holds this one until then.
    `delivered`, if set, is called as soon as the broker acknowledged this message, even when an `acked`
    before it failed (which skips the ones after it): what reached the topic, whatever was recorded.
    `refused`, if set, is called as soon as the broker failed to take it (the runner tries the message
    again later): a stage holding its stream back on acknowledgements stops at once, not at its timeout.
    `after_acks`: produced only once every output yielded before it is acknowledged, as a terminal event
    always is, so what its reader produces next cannot overtake them (prefill's hand-off to decode)."""

    topic: str
    key: str
    value: msgspec.Struct
    acked: Callable[[], Awaitable[None]] | None = None
    with_next: bool = False
    delivered: Callable[[], None] | None = None
    after_acks: bool = False
    refused: Callable[[], None] | None = None


class Stage(Protocol):
    name: str  # also the consumer group, span name, metric label and log field
    topics: Topics
    input_type: Any  # a msgspec type (a Struct or a union of tagged Structs)
    ordered: bool  # True: one message at a time per partition (the stage keeps per-request state)

    def handle(self, message: Any) -> AsyncIterator[Out]: ...


@runtime_checkable
class Controlled(Protocol):
    """A stage that also hears every message on `topics.control` (all partitions, from now on)."""

    async def on_control(self, message: Any) -> None: ...


@runtime_checkable
class Tabled(Protocol):
    """A stage that also reads every record of `topics.table` (a compacted topic), from its start and on,
    to hold a copy of it in memory (the cache's semantic index, route's view of backend health)."""

    table_type: Any  # the msgspec type of the table's records

    async def on_table(self, record: Any) -> None: ...


@runtime_checkable
class Reporting(Protocol):
    """A stage with something to publish on a clock, not in answer to a message (backend health)."""

    def report(self) -> list[Out]: ...


@runtime_checkable
class Ending(Protocol):
    """A stage that knows, in memory, whose terminal event it has already put on the reply topic: the
    runner asks it before it ends a request itself (a message that waited out an outage past the
    request's deadline), so a request that has its ending gets no second one; and tells it when it did
    put one there itself (that, or a dead-lettered message's error), so the stage sends none after it.
    Both take the request's `Address.state_id`."""

    def has_ended(self, state_id: str) -> bool: ...

    def note_ended(self, state_id: str) -> None: ...


@runtime_checkable
class Resettable(Protocol):
    """A stage that caches per-request state in front of its store. The runner resets one request
    before handling its message again (an infrastructure error interrupted it), and all of them when
    its partitions are revoked (another worker may own those requests now)."""

    async def reset(self, request_id: str | None) -> None: ...


@runtime_checkable
class Closable(Protocol):
    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Address:
    """Who a request is and where its terminal event goes, as far as a message tells; builds the
    request's terminal events, so every stage ends a request the same way."""

    request_id: str
    reply_to: str
    tenant: str = ""
    model: str = ""
    created_at: float = 0.0
    deadline_s: float = 300.0
    ticket: Ticket | None = None  # a cache miss's ticket: its Done carries it to emit
    nonce: str | None = None  # a refusal under the client's bare id: the refused record (`Failed.nonce`)

    @property
    def deadline(self) -> float:
        return self.created_at + self.deadline_s if self.created_at else time.time() + self.deadline_s

    @property
    def state_id(self) -> str:
        """What a stage keeps this request's state under (`state_id`)."""
        return _state_id(self.request_id, self.nonce)

    def failed(
        self, code: ErrorCode, message: str, *, chunks: int = 0, usage: Usage = Usage(),
        timings: dict[str, float] | None = None, retry_after_s: float | None = None, rate_limit: RateLimit | None = None,
    ) -> Failed:
        return Failed(
            id=self.request_id, reply_to=self.reply_to, code=code, message=message, retriable=retriable(code),
            tenant=self.tenant, model=self.model, created_at=self.created_at, chunks=chunks, usage=usage,
            timings=timings or {}, retry_after_s=retry_after_s, rate_limit=rate_limit, deadline_s=self.deadline_s,
            nonce=self.nonce,
        )

    def done(self, *, chunks: int, digest: str, finish: FinishReason, usage: Usage, timings: dict[str, float]) -> Done:
        return Done(
            id=self.request_id, reply_to=self.reply_to, chunks=chunks, digest=digest, finish_reason=finish,
            usage=usage, tenant=self.tenant, model=self.model, created_at=self.created_at, timings=timings,
            ticket=self.ticket, deadline_s=self.deadline_s,
        )

    def chunk(self, seq: int, text: str, token_ids: tuple[int, ...] = ()) -> Chunk:
        return Chunk(id=self.request_id, reply_to=self.reply_to, seq=seq, text=text, tenant=self.tenant, token_ids=token_ids,
                     model=self.model)


def address_of(message: object) -> Address | None:
    if isinstance(message, Admitted):  # Routed and Prefilled too
        r = message.request
        return Address(message.id, r.reply_to, message.tenant, r.model, r.created_at, r.deadline_s, message.cache)
    if isinstance(message, Request):  # not authenticated yet: the client's id, no tenant
        return Address(message.id, message.reply_to, "", message.model, message.created_at, message.deadline_s)
    if isinstance(message, Failed):
        return Address(message.id, message.reply_to, message.tenant, message.model, message.created_at, message.deadline_s,
                       nonce=message.nonce)
    if isinstance(message, Done):
        return Address(message.id, message.reply_to, message.tenant, message.model, message.created_at, message.deadline_s)
    if isinstance(message, Chunk):
        return Address(message.id, message.reply_to, message.tenant, message.model)
    return None


def state_id(event: Chunk | Done | Failed) -> str:
    """What a stage keeps the state of an event's request under: the request's id, or, for a refusal
    under a client's bare id, the id and the refused record's nonce. Ingest refuses by the client's id
    (before or without namespacing it), and one id can be refused many times (the same bytes sent again
    after a 429, which ingest admits on purpose; another tenant's or a stranger's request under the same
    id): keyed by id alone, every refusal after the first was taken for a redelivery of it and dropped,
    and its client waited until its timeout. Keyed by record, a replay of the refused record (its group
    sent back to an old offset) is still dropped."""
    return _state_id(event.id, event.nonce if isinstance(event, Failed) else None)


def _state_id(request_id: str, nonce: str | None) -> str:
    return request_id if nonce is None else f"{request_id}@{nonce}"


class Stopwatch:
    """Milliseconds since construction, for the `timings` a stage adds."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def ms(self) -> float:
        return round((time.perf_counter() - self._start) * 1000.0, 3)

"""What a stage is: a named, pure async handler from one decoded message to the messages to send.

A stage imports no Kafka client. The runner (`pipeline.runner`) consumes `input_topics` with the
consumer group `name`, decodes each payload as `input_type`, calls `handle`, produces what it yields,
and commits only after every produce is acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from topics.envelope import Envelope
from topics.requests import Request
from topics.stream import Chunk, Done, Failed


@dataclass(frozen=True)
class Out:
    """One message to produce. `key` is the request id, so a request's messages keep their order."""

    topic: str
    key: str
    value: msgspec.Struct


class Stage(Protocol):
    name: str  # also the consumer group, span name, metric label and log field
    input_topics: tuple[str, ...]
    input_type: Any  # a msgspec type (a Struct or a union of tagged Structs)
    ordered: bool  # True: one message at a time per partition (the stage keeps per-request state)

    def handle(self, message: Any) -> AsyncIterator[Out]: ...


class ControlledStage(Stage, Protocol):
    """A stage that also hears every message on its control topics (all partitions, from now on)."""

    control_topics: tuple[str, ...]
    control_type: Any

    async def on_control(self, message: Any) -> None: ...


@dataclass(frozen=True)
class Address:
    """Where a request's terminal event goes, as far as a message tells."""

    request_id: str
    reply_to: str
    tenant: str = "default"
    model: str = ""
    created_at: float = 0.0


def address_of(message: object) -> Address | None:
    if isinstance(message, Envelope):
        message = message.request
    if isinstance(message, Request):
        return Address(message.id, message.reply_to, message.tenant, message.model, message.created_at)
    if isinstance(message, Chunk | Done | Failed):
        tenant = message.tenant if isinstance(message, Done | Failed) else "default"
        return Address(message.id, message.reply_to, tenant)
    return None


class Stopwatch:
    """Milliseconds since construction, for the `timings` a stage adds."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def ms(self) -> float:
        return round((time.perf_counter() - self._start) * 1000.0, 3)

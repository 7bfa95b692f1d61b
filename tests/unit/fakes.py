"""In-memory stand-ins for unit tests of handlers: a scripted backend, a sink that runs a handler, and for
the runner's handling a producer whose acknowledgements the test gives and a stage that yields what it
is given."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiokafka.structs import ConsumerRecord

from pipeline.backends.base import Delta, GenerationRequest, Prefilled
from pipeline.backends.errors import Cancelled
from pipeline.stage import Out, Stage
from pipeline.topology import Topics
from topics import codec
from topics.hops import Admitted


class ScriptedBackend:
    """Answers every request with `words`, one per step, after `prefill_steps` steps of prefill; `cancel`
    stops a request at its next step."""

    name = "scripted"

    def __init__(self, words: list[str], step_s: float = 0.0, prefill_steps: int = 0) -> None:
        self.words = words
        self.step_s = step_s
        self.prefill_steps = prefill_steps
        self.cancelled: set[str] = set()
        self.steps: dict[str, int] = {}
        self.prefilled: list[str] = []  # request ids whose prefill began

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return sum(len(m.content.split()) for m in request.messages) + len((request.prompt or "").split())

    async def prefill(self, request: GenerationRequest) -> Prefilled:
        self.prefilled.append(request.request_id)
        for _ in range(self.prefill_steps):
            await asyncio.sleep(self.step_s)
            if request.request_id in self.cancelled:
                raise Cancelled(request.request_id)
        done = "length" if request.max_tokens == 1 else None
        return Prefilled("h-" + request.request_id, 0, self.words[0], self.count_prompt_tokens(request), done)

    async def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        """Word i is token i; a resumed request goes on after its resume tokens and `prefilled`'s token."""
        limit = min(request.max_tokens, len(self.words))
        for i in range(len(request.resume_token_ids) + 1, limit):
            await asyncio.sleep(self.step_s)
            if request.request_id in self.cancelled:
                raise Cancelled(request.request_id)
            self.steps[request.request_id] = i
            last = i == limit - 1
            reason = ("length" if limit == request.max_tokens else "stop") if last else None
            yield Delta(self.words[i], (i,), reason)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        first = await self.prefill(request)
        yield Delta(first.first_text, (first.first_token_id,), first.finish_reason)
        async for delta in self.decode(request, first):
            yield delta

    async def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    async def aclose(self) -> None:
        return None


async def run_handler(stage: Stage, message: Any) -> list[Out]:
    """The testing sink: every message the handler yields for `message`, in order, each acknowledged
    (its `acked` run) as the runner would once the broker acknowledged it."""
    outs = []
    async for out in stage.handle(message):
        outs.append(out)
        if out.acked is not None:
            await out.acked()
    return outs


class InstantAcks:
    """The runner's producer, acknowledging every record at once; `send_together` declines (records go one
    by one). `sent`: (topic, value) per record."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        self.sent.append((topic, value))
        ack = asyncio.get_running_loop().create_future()
        ack.set_result(None)
        return ack

    async def send_together(self, topic: str, key: bytes, items: list[Any]) -> None:
        return None

    def topics(self) -> list[str]:
        return [topic for topic, _ in self.sent]


class HeldAcks:
    """The runner's producer, acknowledging nothing until the test resolves `pending` (`release()`: all).
    `calls`: ("one" | "batch", [values]) per send; `produced`: the same with the topic each send went to,
    ("one" | "batch", topic, [values]); `send_together` declines (None) unless `fits`."""

    def __init__(self, fits: bool = True) -> None:
        self.fits = fits
        self.calls: list[tuple[str, list[bytes]]] = []
        self.produced: list[tuple[str, str, list[bytes]]] = []
        self.pending: list[asyncio.Future[Any]] = []

    def _ack(self) -> asyncio.Future[Any]:
        ack = asyncio.get_running_loop().create_future()
        self.pending.append(ack)
        return ack

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        self.calls.append(("one", [value]))
        self.produced.append(("one", topic, [value]))
        return self._ack()

    async def send_together(self, topic: str, key: bytes, items: list[tuple[bytes, list[tuple[str, bytes]]]]) -> asyncio.Future[Any] | None:
        if not self.fits:
            return None
        self.calls.append(("batch", [value for value, _ in items]))
        self.produced.append(("batch", topic, [value for value, _ in items]))
        return self._ack()

    def release(self) -> None:
        for ack in self.pending:
            if not ack.done():
                ack.set_result(None)


@dataclass
class Yields:
    """A stage that yields the outputs it is given, whatever the message."""

    outs: list[Out]
    name: str = "yields"
    topics: Topics = Topics(("t.in",), None, "t.stream")
    input_type: Any = Admitted
    ordered: bool = False

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        for out in self.outs:
            yield out


def record_of(
    message: Any, topic: str = "t.in", *, offset: int = 7, key: bytes | None = None, value: bytes | None = None,
) -> ConsumerRecord[bytes, bytes]:
    """`message` as the consumer hands it over (`value`: other bytes in its place, an unreadable payload)."""
    value = codec.encode(message) if value is None else value
    return ConsumerRecord(topic, 0, offset, 0, 0, key, value, None, 0, len(value), [])


class Clock:
    """A clock the test moves by hand (`clock.now += 1.0`)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

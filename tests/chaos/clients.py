"""The chaos suite's clients: streaming requests through the SDK, paced, each one recorded in full.

For every request: each chunk as the SDK's iterator delivered it (seq, text, monotonic arrival time)
and how it ended (done, an error terminal event with its code, no terminal before the deadline, or an
exception in the client). The SDK drops redelivered chunks itself; the checker also reads the topics.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.sdk import Client, RequestFailed
from tests.chaos.scenarios import RequestSpec

log = logging.getLogger(__name__)
GIVE_UP_AFTER_S = 20.0  # past a request's deadline (the SDK's own grace is 10 s)


class NoAnswer(Exception):
    """The pipeline did not answer a probe request in time."""


@dataclass
class ClientResult:
    scenario: str
    spec: RequestSpec
    request_id: str
    sent_at: float  # monotonic, when the SDK was asked to send
    chunks: list[tuple[int, str, float]] = field(default_factory=list)  # (seq, text, arrival)
    outcome: str = "pending"  # done | failed | no_terminal | client_error
    code: str | None = None  # failed: the error code; client_error: the exception type
    ended_at: float | None = None
    done_chunks: int | None = None
    cache: str | None = None  # done: the cache tier that answered (None: generated)
    done_digest: str | None = None
    finish_reason: str | None = None
    # `stream.aclose()` raised (its exception's type). The SDK logs a cancel the broker would not take and
    # returns (`sdk._cancel`), so anything here escaped `aclose()` itself: the checker calls it a violation.
    cleanup_error: str | None = None

    @property
    def text(self) -> str:
        return "".join(text for _, text, _ in self.chunks)

    def as_dict(self) -> dict[str, object]:
        return {
            "scenario": self.scenario, "spec": self.spec.key, "id": self.request_id, "outcome": self.outcome,
            "code": self.code, "chunks": len(self.chunks), "finish_reason": self.finish_reason,
            "cleanup_error": self.cleanup_error,
        }


async def stream_one(
    client: Client, scenario: str, spec: RequestSpec, prompt: str, give_up_s: float | None = None
) -> ClientResult:
    """One streaming request, recorded; it is given up `give_up_s` after sending (default: deadline + 20 s)."""
    stream = client.stream(prompt=prompt, max_tokens=spec.max_tokens, temperature=0.0, deadline_s=spec.deadline_s)
    result = ClientResult(scenario, spec, stream.id, time.monotonic())
    try:
        async with asyncio.timeout(give_up_s if give_up_s is not None else spec.deadline_s + GIVE_UP_AFTER_S):
            async for chunk in stream:
                result.chunks.append((chunk.seq, chunk.text, time.monotonic()))
        done: Any = stream.done
        result.outcome = "done"
        result.done_chunks = getattr(done, "chunks", None)
        result.done_digest = getattr(done, "digest", None)
        tier = getattr(done, "cache", None)
        result.cache = None if tier is None else str(getattr(tier, "value", tier))
        reason = getattr(done, "finish_reason", None)
        result.finish_reason = str(getattr(reason, "value", reason))
    except RequestFailed as exc:
        result.outcome, result.code = "failed", str(exc.code.value)
    except TimeoutError:
        result.outcome = "no_terminal"
    except Exception as exc:  # the client itself failed (a produce timed out during an outage): recorded, reported
        result.outcome, result.code = "client_error", type(exc).__name__
    finally:
        result.ended_at = time.monotonic()
    try:
        await stream.aclose()
    except Exception as exc:  # kept with the result: the checker flags it (`checker._check_client`)
        result.cleanup_error = type(exc).__name__
    return result


async def run_load(
    client: Client, scenario: str, specs: list[RequestSpec], rate: float, nonce: str, repeat_after: int = 0
) -> list[ClientResult]:
    """One request per spec, `rate` new ones per second, each with a prompt of its own, except that with
    `repeat_after` every fourth request from that one on asks what the request `repeat_after` before it
    asked (`Profile.repeat_after`); returns when every request has ended (each is bounded by its deadline
    plus `GIVE_UP_AFTER_S`)."""
    tasks: list[asyncio.Task[ClientResult]] = []
    tag = f"{nonce}-{zlib.crc32(scenario.encode()):08x}"  # plain words only: the input guard reads prompts
    asked: list[tuple[RequestSpec, str]] = []
    for j, spec in enumerate(specs):
        if repeat_after and j >= repeat_after and j % 4 == 3:
            spec, prompt = asked[j - repeat_after]
        else:
            prompt = f"Please count to {spec.max_tokens}. (set {tag}, request {j})"
        asked.append((spec, prompt))
        tasks.append(asyncio.create_task(stream_one(client, scenario, spec, prompt)))
        await asyncio.sleep(1.0 / rate)
    return list(await asyncio.gather(*tasks))


async def probe(client: Client, timeout_s: float) -> float:
    """One short request end to end, waited for up to `timeout_s` (sent again only if it failed); its seconds."""
    deadline = time.monotonic() + timeout_s
    spec = RequestSpec("probe", 2, deadline_s=timeout_s)
    attempt = 0
    while True:
        attempt += 1
        started = time.monotonic()
        left = max(1.0, deadline - started)
        result = await stream_one(client, "probe", spec, f"probe {attempt} at {time.time():.3f}", give_up_s=left)
        if result.outcome == "done":
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            raise NoAnswer(f"the pipeline did not answer a probe within {timeout_s:.0f} s (last: {result.outcome} {result.code or ''})")
        await asyncio.sleep(1.0)


async def stop_quietly(stop: Callable[[], Awaitable[None]]) -> None:
    """Stop a Kafka client. aiokafka's stop() may re-raise the CancelledError of one of its own tasks
    (seen after a broker restart); that one is logged, while a cancellation of this task goes on up."""
    try:
        await stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("a Kafka client's stop() raised its own task's CancelledError", exc_info=True)

"""One request through the pipeline, answered over HTTP: server-sent events when streaming, else one body.

The status is decided by the first event, so an error before the first chunk is a plain JSON error
with its own status; an error after it is an SSE `data: {"error": ...}` event followed by `[DONE]`.

Why not Starlette's `StreamingResponse`: under uvicorn (ASGI HTTP spec 2.3) it stops its body iterator
by cancelling an anyio scope, and that scope also cancels every await in the iterator's cleanup, so the
SDK stream's cancellation on `llm.control` would never be sent; under spec 2.4 it does not close the
iterator at all. `RelayResponse` watches `receive()` for `http.disconnect` itself and, when the client
leaves, cancels the relay task once (plain asyncio); leaving `async with stream` then closes the SDK
stream, whose cleanup produces the cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from aiokafka.errors import KafkaError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.bridge.openai_format import (
    DONE_EVENT,
    Json,
    Parsed,
    Reply,
    completion,
    error_body,
    failed_error,
    sse_event,
    stream_chunk,
    stream_finish,
    stream_usage,
    to_json,
)
from pipeline.metrics import HANDLE_SECONDS, IN_FLIGHT, MESSAGES
from pipeline.sdk import Client, RequestFailed, Stream
from topics.cache import CacheTier
from topics.errors import ErrorCode, http_status
from topics.requests import Request
from topics.stream import Chunk, Done, Failed

STAGE = "bridge"  # the metric label and log field of every request the bridge answers

log = logging.getLogger(__name__)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
TIMEOUT_MESSAGE = "no answer arrived within the request's deadline"


class Tally:
    """Counts one bridge request in the shared stage metrics: in flight, duration and outcome."""

    def __init__(self) -> None:
        self.outcome = "error"  # "done", an ErrorCode value, "client_gone"; "error" if an exception escaped
        self._started = 0.0

    def __enter__(self) -> Tally:
        self._started = time.perf_counter()
        IN_FLIGHT.labels(STAGE).inc()
        return self

    def __exit__(self, *exc: object) -> None:
        IN_FLIGHT.labels(STAGE).dec()
        HANDLE_SECONDS.labels(STAGE).observe(time.perf_counter() - self._started)
        MESSAGES.labels(STAGE, self.outcome).inc()


def finished(stream: Stream) -> Done:
    """`stream.done` after its iteration ended normally (the SDK sets it then)."""
    if stream.done is None:
        raise RuntimeError(f"stream {stream.id} ended without its done event")
    return stream.done


class RelayResponse(Response):
    def __init__(self, client: Client, request: Request, parsed: Parsed, on_end: Callable[[], None] = lambda: None) -> None:
        self._client = client
        self._on_end = on_end  # called once, when the response is over however it ended
        self._request = request
        self._parsed = parsed
        self._reply = Reply(parsed.kind, request.id, request.model, int(request.created_at), parsed.include_usage)
        self._tally = Tally()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._answer(receive, send)
        finally:
            self._on_end()

    async def _answer(self, receive: Receive, send: Send) -> None:
        """Relays in this task while a watcher waits for the client to leave; if it does first, the watcher
        cancels this task once (one task and no `asyncio.wait` per request: the relay in a task of its
        own beside the watcher cost a task and two waits more)."""
        task = asyncio.current_task()
        assert task is not None
        left = False

        def client_left(watch: asyncio.Task[None]) -> None:
            nonlocal left
            if not watch.cancelled():
                left = True
                task.cancel()

        with self._tally:
            watch = asyncio.create_task(_disconnected(receive))
            watch.add_done_callback(client_left)
            try:
                await self._relay(send)
            except asyncio.CancelledError:
                if not left or task.uncancel() > 0:  # not the watcher's, or someone else's as well
                    raise
                if (error := watch.exception()) is not None:
                    raise error from None
                self._tally.outcome = "client_gone"
                log.info("client went away; request %s cancelled", self._request.id)
            finally:
                watch.remove_done_callback(client_left)
                watch.cancel()

    async def _relay(self, send: Send) -> None:
        async with self._client.stream(self._request) as stream:  # leaving it early cancels the request
            try:
                first = await anext(aiter(stream), None)
            except RequestFailed as exc:
                self._tally.outcome = exc.code.value
                await _send_json(send, *failed_error(exc.failed), headers=limit_headers(exc.failed))
                return
            except TimeoutError:
                await self._timed_out(send)
                return
            except KafkaError as exc:  # the broker refused the request for good (an outage is waited out)
                await self._unavailable(send, exc)
                return
            if self._parsed.stream:
                await self._send_events(send, first, stream)
            else:
                await self._send_whole(send, first, stream)

    async def _send_whole(self, send: Send, first: Chunk | None, stream: Stream) -> None:
        texts = [first.text] if first is not None else []
        try:
            texts += [chunk.text async for chunk in stream]
        except RequestFailed as exc:
            self._tally.outcome = exc.code.value
            await _send_json(send, *failed_error(exc.failed))
            return
        except TimeoutError:
            await self._timed_out(send)
            return
        done = finished(stream)
        self._tally.outcome = "done"
        body = completion(self._reply, "".join(texts), done.finish_reason, done.usage)
        await _send_json(send, 200, body, headers=[cache_header(done.cache)])

    async def _send_events(self, send: Send, first: Chunk | None, stream: Stream) -> None:
        reply = self._reply
        tier = first.cache if first is not None else stream.done.cache if stream.done is not None else None
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, cache_header(tier)]})
        await _send_body(send, sse_event(stream_chunk(reply, first.text if first else "", first=True)))
        try:
            async for chunk in stream:
                await _send_body(send, sse_event(stream_chunk(reply, chunk.text)))
        except RequestFailed as exc:
            self._tally.outcome = exc.code.value
            await _send_body(send, sse_event(failed_error(exc.failed)[1]))
        except TimeoutError:
            self._tally.outcome = ErrorCode.deadline_exceeded.value
            await _send_body(send, sse_event(error_body(TIMEOUT_MESSAGE, code=ErrorCode.deadline_exceeded)))
        else:
            done = finished(stream)
            self._tally.outcome = "done"
            await _send_body(send, sse_event(stream_finish(reply, done.finish_reason)))
            if reply.include_usage:
                await _send_body(send, sse_event(stream_usage(reply, done.usage)))
        await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})

    async def _unavailable(self, send: Send, exc: KafkaError) -> None:
        code = ErrorCode.unavailable
        self._tally.outcome = code.value
        log.warning("request %s could not be sent to Kafka: %s", self._request.id, type(exc).__name__)
        await _send_json(send, http_status(code), error_body("the pipeline could not take the request; retry", code=code),
                         headers=[(b"retry-after", b"1")])

    async def _timed_out(self, send: Send) -> None:
        code = ErrorCode.deadline_exceeded
        self._tally.outcome = code.value
        log.warning("no terminal event for request %s within its deadline", self._request.id)
        await _send_json(send, http_status(code), error_body(TIMEOUT_MESSAGE, code=code))


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone away (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": True})


def cache_header(tier: CacheTier | None) -> tuple[bytes, bytes]:
    """`x-sluice-cache: hit-exact | hit-semantic | miss`: whether the cache answered, and which tier."""
    return b"x-sluice-cache", (tier.value if tier is not None else "miss").encode()


def limit_headers(failed: Failed) -> list[tuple[bytes, bytes]]:
    """`Retry-After` (whole seconds, rounded up) and `x-ratelimit-*` for a refusal that carries them."""
    headers = []
    if failed.retry_after_s is not None and math.isfinite(failed.retry_after_s):  # handed over in memory: unchecked
        headers.append((b"retry-after", str(max(1, math.ceil(failed.retry_after_s))).encode()))
    if (limit := failed.rate_limit) is not None:
        kind = limit.resource
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(limit.limit).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(limit.remaining).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), f"{limit.reset_s:.3f}s".encode()),
            (b"x-ratelimit-scope", limit.scope.encode()),
        ]
    return headers


async def _send_json(send: Send, status: int, body: Json, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = to_json(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


__all__ = ["STAGE", "TIMEOUT_MESSAGE", "RelayResponse", "Tally", "finished"]

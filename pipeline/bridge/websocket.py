"""`/v1/stream`: many requests over one WebSocket, answered concurrently.

The client sends one JSON chat-completions body per message (ids are ours, not the client's). For each
message, in the order they arrive, the bridge answers at once with either

    {"type": "start", "id": ..., "model": ...}                the request went into the pipeline
    {"type": "error", "id": null, "code", "message", "param", "retriable"}   the message was refused as it stands

so the n-th `start` or refusal belongs to the n-th message. A socket runs at most `bridge.ws_max_requests`
requests at once (HTTP/2's MAX_CONCURRENT_STREAMS): a message past it is refused with `rate_limited`
before it reaches Kafka, so one socket cannot queue thousands of requests ahead of every other client
(each stage works on `runtime.max_in_flight` at once). A started request then gets

    {"type": "chunk", "id", "seq", "text"}                    zero or more, seq 0..n-1
    {"type": "done", "id", "finish_reason", "chunks", "usage": {...}}   or
    {"type": "error", "id", "code", "message", "retriable"}

and messages of concurrent requests interleave. A `Cache-Control: no-cache` / `no-store` header on the
handshake applies to every request on the socket, as on each HTTP request. When the socket closes,
every request still running on it is cancelled (the SDK stream's cleanup sends the cancellation on `llm.control`).
A socket with no request running for `bridge.ws_idle_s` is closed with code 1000 (keepalive pings, which
uvicorn answers, do not count). A client that stops reading loses the socket after `bridge.send_timeout_s`
(edges.SendDeadline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka.errors import KafkaError
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from pipeline.bridge.admission import Admission
from pipeline.bridge.openai_format import (
    BridgeError,
    Json,
    PayloadTooLarge,
    decode_body,
    parse_chat,
    to_json,
    usage_body,
    validated,
)
from pipeline.bridge.relay import TIMEOUT_MESSAGE, Tally, finished
from pipeline.sdk import Client, RequestFailed
from topics.errors import ErrorCode, retriable
from topics.requests import Request

log = logging.getLogger(__name__)
IDLE_CLOSE = 1000  # the close code of a socket idle for `bridge.ws_idle_s`: a normal closure


class TooManyOnSocket(BridgeError):
    """A message while the socket already runs `bridge.ws_max_requests` requests: the client's own load, so
    `rate_limited` (retry once one of its requests ends), not the bridge-wide `unavailable`."""

    status = 429
    code = ErrorCode.rate_limited


class StreamSession:
    """One accepted WebSocket and the requests running on it."""

    def __init__(
        self, websocket: WebSocket, client: Client, max_message_bytes: int,
        prepare: Callable[[Request], Request] = lambda request: request, admission: Admission | None = None,
        *, max_requests: int = 32, idle_s: float = 300.0,
    ) -> None:
        """`prepare` adds what the connection knows to each request (the client address, as over HTTP, and
        the caller's credential as the bridge passes it on: bridge/credentials.py). `max_requests`: how many
        may run on the socket at once; `idle_s`: how long the socket stays open with none running."""
        self._ws = websocket
        self._client = client
        self._max_bytes = max_message_bytes
        self._prepare = prepare
        self._admission = admission or Admission(0)  # the bridge's bound on requests open at once
        self._max_requests = max_requests
        self._idle_s = idle_s
        self._idle: asyncio.Timeout | None = None  # armed while no request runs and the reader waits; None after
        self._reading = False  # the reader is waiting for the next message
        self._running: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        """Reads requests until the client goes away or the socket has been idle `idle_s` (then it is closed),
        and cancels what is still running."""
        try:
            async with asyncio.timeout(self._idle_s) as idle:
                self._idle = idle
                while True:
                    self._reading = True
                    message = await self._ws.receive()
                    self._reading = False
                    if message["type"] == "websocket.disconnect":
                        return
                    idle.reschedule(None)  # a message is activity; its request keeps the socket open
                    await self._start(message)
                    self._arm_idle()
        except TimeoutError:
            if not idle.expired():
                raise
            await self._close_idle()
        finally:
            self._idle = None
            running = tuple(self._running)
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)  # each task's cleanup produces its cancellation

    def _arm_idle(self) -> None:
        """The idle clock runs from now if no request runs on the socket, else it stops."""
        if self._idle is not None and not self._idle.expired():
            self._idle.reschedule(None if self._running else asyncio.get_running_loop().time() + self._idle_s)

    async def _close_idle(self) -> None:
        log.debug("a websocket was idle for %g s: closed", self._idle_s)
        try:
            async with self._send_lock:
                await self._ws.close(IDLE_CLOSE, f"no request for {self._idle_s:g} s")
        except (WebSocketDisconnect, WebSocketDisconnected):
            pass  # the client left first: nothing to close

    async def _start(self, message: Message) -> None:
        text, data = message.get("text"), message.get("bytes")
        raw = text.encode() if text is not None else (data or b"")
        try:
            if len(raw) > self._max_bytes:
                raise PayloadTooLarge(f"the message is {len(raw)} bytes; the limit is {self._max_bytes}")
            if len(self._running) >= self._max_requests:
                raise TooManyOnSocket(f"this socket has {len(self._running)} requests running, its limit "
                                      "(bridge.ws_max_requests); send more as they end")
            parsed = parse_chat(decode_body(raw))
            request = self._prepare(validated(lambda: self._client.request(**{**parsed.request_kwargs(), "stream": True})))
            self._admission.enter()
        except BridgeError as exc:
            await self._send({"type": "error", "id": None, "code": exc.code.value, "message": exc.message,
                              "param": exc.param, "retriable": retriable(exc.code)})
            return
        except Exception:  # a bug in reading one message must not end the others on the socket
            log.exception("a websocket message could not be read")
            await self._send({"type": "error", "id": None, "code": ErrorCode.internal.value,
                              "message": "the bridge failed on this message", "param": None,
                              "retriable": retriable(ErrorCode.internal)})
            return
        try:
            await self._send({"type": "start", "id": request.id, "model": request.model})
        except BaseException:
            self._admission.leave()  # no task: _finished, which leaves it otherwise, never runs
            raise
        task = asyncio.create_task(self._serve(request))
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._admission.leave()  # here, not in _serve: a task cancelled before it started never runs its body
        self._running.discard(task)
        if self._reading and not self._running:
            self._arm_idle()  # (while a message is being started, the reader re-arms it after)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a websocket request ended with an error it could not report", exc_info=error)

    async def _serve(self, request: Request) -> None:
        with Tally() as tally:
            try:
                tally.outcome = await self._relay(request)
            except asyncio.CancelledError:
                tally.outcome = "client_gone"  # the socket closed; leaving the stream cancelled the request
                raise
            except (WebSocketDisconnect, WebSocketDisconnected):
                tally.outcome = "client_gone"  # the reader sees the close too and cancels the rest
            except KafkaError as exc:  # the broker refused the request for good (an outage is waited out)
                tally.outcome = ErrorCode.unavailable.value
                log.warning("websocket request %s could not be sent to Kafka: %s", request.id, type(exc).__name__)
                await self._send(_error(request.id, ErrorCode.unavailable, "the pipeline could not take the request; retry"))
            except Exception:  # last resort for one request on a shared socket: log it, tell the client, keep the socket
                log.exception("websocket request %s failed", request.id)
                await self._send(_error(request.id, ErrorCode.internal, "the bridge failed on this request"))

    async def _relay(self, request: Request) -> str:
        """Sends the request's chunks and its terminal message; returns the outcome for the metrics."""
        async with self._client.stream(request) as stream:  # leaving it early cancels the request
            try:
                async for chunk in stream:
                    await self._send({"type": "chunk", "id": request.id, "seq": chunk.seq, "text": chunk.text})
            except RequestFailed as exc:
                await self._send(_error(request.id, exc.code, exc.failed.message))
                return exc.code.value
            except TimeoutError:
                await self._send(_error(request.id, ErrorCode.deadline_exceeded, TIMEOUT_MESSAGE))
                return ErrorCode.deadline_exceeded.value
        done = finished(stream)
        await self._send({
            "type": "done",
            "id": request.id,
            "finish_reason": done.finish_reason,
            "chunks": done.chunks,
            "usage": usage_body(done.usage),
        })
        return "done"

    async def _send(self, message: Json) -> None:
        async with self._send_lock:
            await self._ws.send_text(to_json(message).decode())


def _error(request_id: str, code: ErrorCode, message: str) -> Json:
    return {"type": "error", "id": request_id, "code": code.value, "message": message, "retriable": retriable(code)}


__all__ = ["StreamSession", "TooManyOnSocket"]

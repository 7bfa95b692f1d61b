"""One line of a job through the pipeline: a request on the batch lane, and the line to record.

`Executor.run(line)` builds the request from the line's parsed body exactly as the bridge builds an
interactive one (`Client.request(**parsed.request_kwargs())`), puts it on the batch lane
(`priority = batch`: ingest, guard, cache, route and usage treat it like any request; the engine
schedules it behind interactive work), signs it as the job's owner, and waits for its terminal event.
A retriable refusal (429 with its Retry-After, 503, 504, a backend error) is tried again, up to
`max_attempts`, each time as a new request with a new id; anything else is the line's answer.
A line the signer refuses (the owner's JWT has expired: service.signer_for) is answered 401
`unauthorized` without being sent, on any attempt.

Output lines follow OpenAI's batch format: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. A line that never got a response (refused by validation, or the job
was cancelled or expired first) has `"response": null` and `"error": {"code", "message", "line", "param"}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from pipeline.batch.records import Recorded
from pipeline.batch.validation import Line, Rejected
from pipeline.bridge.openai_format import Reply, completion, error_body
from pipeline.errors import StageError
from pipeline.sdk import Completion, RequestFailed
from topics.errors import ErrorCode, http_status
from topics.requests import Priority, Request

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
_encode = msgspec.json.Encoder().encode


class Completer(Protocol):
    """What the executor needs of `pipeline.sdk.Client`."""

    def request(self, **kwargs: Any) -> Request: ...

    async def complete(self, request: Request | None = None, **kwargs: object) -> Completion: ...


Sign = Callable[[Request], Request]


class Executor:
    def __init__(
        self, client: Completer, sign: Sign, *, deadline_s: float, max_attempts: int, api_key: str | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        self._sign = sign
        self._api_key = api_key  # direct mode only (`sluice batch run`): the caller's own key, in memory
        self._deadline_s = deadline_s
        self._max_attempts = max_attempts
        self._sleep = sleep

    def build(self, line: Line) -> Request:
        kwargs = line.parsed.request_kwargs()
        request = self._client.request(**kwargs, deadline_s=self._deadline_s, priority=Priority.batch.value, api_key=self._api_key)
        return self._sign(request)

    async def run(self, line: Line) -> Recorded:
        for attempt in range(1, self._max_attempts + 1):
            try:
                request = self.build(line)
            except msgspec.ValidationError as exc:  # passed the bridge's parser but not the wire schema
                body = error_body(f"the body is not a valid request: {exc}", code=ErrorCode.invalid_request)
                return Recorded(line.number, False, response_line(line.custom_id, "", 400, body))
            except StageError as exc:  # the signer refused: the owner's JWT expired (service.signer_for); never sent
                body = error_body(exc.message, code=exc.code)
                return Recorded(line.number, False, response_line(line.custom_id, "", http_status(exc.code), body))
            try:
                answer = await self._client.complete(request)
            except RequestFailed as exc:
                failed = exc.failed
                if failed.retriable and attempt < self._max_attempts:
                    await self._sleep(min(failed.retry_after_s or 2.0 ** attempt, MAX_BACKOFF_S))
                    continue
                body = error_body(failed.message, code=failed.code)
                return Recorded(line.number, False, response_line(line.custom_id, request.id, http_status(failed.code), body))
            except TimeoutError:
                if attempt < self._max_attempts:
                    continue
                code = ErrorCode.deadline_exceeded
                body = error_body("no answer arrived within the line's deadline", code=code)
                return Recorded(line.number, False, response_line(line.custom_id, request.id, http_status(code), body))
            except KafkaError as exc:  # the broker refused the request for good (the SDK waits out an outage)
                too_large = isinstance(exc, MessageSizeTooLargeError)
                code = ErrorCode.invalid_request if too_large else ErrorCode.unavailable
                text = "the request is larger than a Kafka record may be" if too_large else "the pipeline could not take the request"
                return Recorded(line.number, False, response_line(line.custom_id, request.id, 413 if too_large else http_status(code),
                                                                  error_body(text, code=code)))
            except Exception:  # this line's failure, recorded: the job goes on (it crash-looped on one line before)
                log.exception("batch line %d failed in the worker", line.number)
                code = ErrorCode.internal
                body = error_body("the batch worker failed on this line", code=code)
                return Recorded(line.number, False, response_line(line.custom_id, request.id, http_status(code), body))
            reply = Reply(line.parsed.kind, request.id, request.model, int(request.created_at))
            body = completion(reply, answer.text, answer.done.finish_reason, answer.done.usage)
            return Recorded(line.number, True, response_line(line.custom_id, request.id, 200, body))
        raise AssertionError("unreachable: the last attempt always returns")


def response_line(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> bytes:
    response = {"status_code": status, "request_id": request_id, "body": body}
    return _encode({"id": "batch_req_" + request_id, "custom_id": custom_id, "response": response, "error": None})


def error_line(batch_id: str, number: int, custom_id: str | None, code: str, message: str, param: str | None = None) -> bytes:
    error = {"code": code, "message": message, "line": number, "param": param}
    return _encode({"id": f"batch_req_{batch_id.removeprefix('batch_')}_{number}", "custom_id": custom_id,
                    "response": None, "error": error})


def rejected(batch_id: str, line: Rejected) -> Recorded:
    return Recorded(line.number, False, error_line(batch_id, line.number, line.custom_id, line.code, line.message, line.param))


def unrun(batch_id: str, line: Line, code: str, message: str) -> Recorded:
    """A line the job ended without running (cancelled, expired)."""
    return Recorded(line.number, False, error_line(batch_id, line.number, line.custom_id, code, message))


def now_s() -> int:
    return int(time.time())


__all__ = ["Completer", "Executor", "error_line", "rejected", "response_line", "unrun"]

"""A stand-in for the SDK client: answers each batch request at once (or fails it, or waits), and counts
how often each prompt ran, so a test can tell which lines ran again."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import msgspec

from pipeline.sdk import Completion, RequestFailed
from topics.errors import ErrorCode, retriable
from topics.requests import Request
from topics.stream import Done, Failed, FinishReason, Usage


def prompt_of(request: Request) -> str:
    return request.prompt if request.prompt is not None else " ".join(m.content for m in request.messages)


class FakeCompleter:
    def __init__(self, *, fail: dict[str, ErrorCode] | None = None, delay_s: float = 0.0,
                 raises: dict[str, Exception] | None = None) -> None:
        self.fail = fail or {}  # prompt -> the error it always ends with
        self.raises = raises or {}  # prompt -> what sending it raises (the broker refusing it, a bug)
        self.delay_s = delay_s
        self.runs: Counter[str] = Counter()  # prompt -> times it was sent
        self.finished: Counter[str] = Counter()  # prompt -> times an answer came back
        self.requests: list[Request] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None  # set: requests wait for it

    def request(self, **kwargs: Any) -> Request:
        sampling = {k: kwargs.pop(k) for k in ("max_tokens", "temperature", "top_p", "stop", "seed") if k in kwargs}
        kwargs.pop("api_key", None)
        fields = {"id": uuid.uuid4().hex, "reply_to": "llm.responses.sdk", "created_at": 1.0, "sampling": sampling,
                  "messages": [msgspec.to_builtins(m) for m in kwargs.pop("messages", ())], **kwargs}
        return msgspec.convert(fields, Request)

    async def complete(self, request: Request | None = None, **kwargs: object) -> Completion:
        assert request is not None
        prompt = prompt_of(request)
        if prompt in self.raises:
            raise self.raises[prompt]
        self.requests.append(request)
        self.runs[prompt] += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if prompt in self.fail:
            code = self.fail[prompt]
            raise RequestFailed(Failed(id="t/" + request.id, reply_to=request.reply_to, code=code, message=f"{code.value} here",
                                       retriable=retriable(code), tenant="t", model=request.model, created_at=1.0))
        self.finished[prompt] += 1
        done = Done(id="t/" + request.id, reply_to=request.reply_to, chunks=1, digest="d", finish_reason=FinishReason.stop,
                    usage=Usage(3, 2), tenant="t", model=request.model, created_at=1.0)
        return Completion("answer to " + prompt, done)

"""The instant backend: numbered tokens, no model, for the chaos suite and the transport benchmarks.

    completion token i     id 1000 + i, text "t{i} " (i counts from 0 over the whole completion)
    prompt tokens          len(prompt, or every message's content joined) // 4 + 1
    finish reasons         "length" at `max_tokens`; "stop" when a stop string completes (never a stop token)
    token_delay_ms         awaited before every token, so a stream lasts long enough to be killed mid-way

The output depends only on the completion index, so a decode worker that resumes another's stream
emits exactly the text the first one had left to send: the text side is the same `TextStream` the
local backend uses, with a detokenizer that reads the numbers back. Resuming, as decode does it:
`decode(request, prefilled)` with `resume_token_ids` = the tokens consumed but the last,
`prefilled.first_token_id` = the last, and `resume_sent_chars` = the characters sent of all of them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from pipeline.backends.base import Delta, GenerationRequest, Prefilled
from pipeline.backends.errors import BackendClosed, Cancelled, InvalidRequest
from pipeline.backends.text_stream import TextStream

__all__ = ["FIRST_TOKEN_ID", "InstantBackend", "token_text"]

FIRST_TOKEN_ID = 1000  # completion token i has id FIRST_TOKEN_ID + i
_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled, so a later decode of one refuses to run


def token_text(token_id: int) -> str:
    """The text of one instant token: `t{i} ` for completion index i."""
    return f"t{token_id - FIRST_TOKEN_ID} "


def _detokenize(ids: Sequence[int]) -> str:
    return "".join(token_text(t) for t in ids)


class InstantBackend:
    def __init__(self, *, name: str = "instant", token_delay_ms: float = 0.0) -> None:
        if token_delay_ms < 0:
            raise ValueError(f"token_delay_ms must not be negative, got {token_delay_ms}")
        self.name = name
        self._delay_s = token_delay_ms / 1000.0
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._closed = False

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(_prompt_text(request)) // 4 + 1

    async def prefill(self, request: GenerationRequest) -> Prefilled:
        self._validate(request)
        prompt_tokens = self.count_prompt_tokens(request)
        index = len(request.resume_token_ids)
        stream = self._text_stream(request, request.resume_token_ids, _sent_chars(request))
        await self._step(request.request_id)
        delta = stream.push(FIRST_TOKEN_ID + index)
        return Prefilled(uuid.uuid4().hex, FIRST_TOKEN_ID + index, delta.text, prompt_tokens, delta.finish_reason)

    async def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        """Continue after `prefilled.first_token_id`. On a takeover (`resume_sent_chars` set) the characters
        sent cover the resume tokens and that token together, and `first_text` is not read (as in local.py)."""
        if prefilled.finish_reason is not None:
            return
        self._check(request.request_id)
        done = (*request.resume_token_ids, prefilled.first_token_id)
        if request.resume_sent_chars is not None:
            sent = request.resume_sent_chars
        else:
            sent = len(_detokenize(request.resume_token_ids)) + len(prefilled.first_text)
        stream = self._text_stream(request, done, sent)
        for index in range(len(done), request.max_tokens):
            await self._step(request.request_id)
            delta = stream.push(FIRST_TOKEN_ID + index)
            yield delta
            if delta.finish_reason is not None:
                return

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        prefilled = await self.prefill(request)
        yield Delta(prefilled.first_text, (prefilled.first_token_id,), prefilled.finish_reason)
        if request.resume_sent_chars is not None:  # decode counts the first token's text as sent too
            request = replace(request, resume_sent_chars=request.resume_sent_chars + len(prefilled.first_text))
        async for delta in self.decode(request, prefilled):
            yield delta

    async def cancel(self, request_id: str) -> None:
        """Running streams of the request raise `Cancelled` at their next token; later ones refuse to start."""
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)

    async def aclose(self) -> None:
        """Running streams end with `BackendClosed` at their next token."""
        self._closed = True

    async def _step(self, request_id: str) -> None:
        """The time of one token, then the checks a real engine makes between steps."""
        if self._delay_s > 0:
            await asyncio.sleep(self._delay_s)
        self._check(request_id)

    def _check(self, request_id: str) -> None:
        if self._closed:
            raise BackendClosed(f"backend {self.name} is closed")
        if request_id in self._cancelled:
            raise Cancelled(f"request {request_id} was cancelled")

    def _validate(self, request: GenerationRequest) -> None:
        if bool(request.messages) == (request.prompt is not None):
            raise InvalidRequest("a request needs exactly one of `messages` (chat) and `prompt` (completion)")
        if not _prompt_text(request):
            raise InvalidRequest("the prompt is empty")
        if request.max_tokens < 1 or len(request.resume_token_ids) >= request.max_tokens:
            raise InvalidRequest(
                f"nothing to generate: max_tokens={request.max_tokens}, resume tokens={len(request.resume_token_ids)}"
            )
        self._check(request.request_id)

    @staticmethod
    def _text_stream(request: GenerationRequest, ids: Sequence[int], sent_chars: int) -> TextStream:
        return TextStream(
            _detokenize, completion_ids=ids, sent_chars=sent_chars, stops=request.stop, max_tokens=request.max_tokens,
            eos_ids=(), token_text=token_text,
        )


def _prompt_text(request: GenerationRequest) -> str:
    return request.prompt if request.prompt is not None else "".join(m.content for m in request.messages)


def _sent_chars(request: GenerationRequest) -> int:
    """Before prefill: characters of the resume tokens' text already sent (all of it unless the request says less)."""
    if request.resume_sent_chars is not None:
        return request.resume_sent_chars
    return len(_detokenize(request.resume_token_ids))

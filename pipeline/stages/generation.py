"""What prefill and decode share: the request as the backend sees it, and how a cancellation ends it."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pipeline.backends.base import GenerationRequest, Message, Prefilled
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import Prefill, client_id_of
from topics.requests import Request

CANCEL_CODE = {  # the terminal event's code for a request stopped by `llm.control`
    CancelReason.client_gone: ErrorCode.cancelled,
    CancelReason.output_guard: ErrorCode.content_filter,
    CancelReason.deadline: ErrorCode.deadline_exceeded,
}
REMEMBER_CANCELLED = 10_000  # cancellations a worker keeps: one may arrive before its request does


class Cancellations:
    """The cancellations a generation worker heard on `llm.control`, the last `REMEMBER_CANCELLED` of them,
    looked up by the pipeline's request id or the client's."""

    def __init__(self) -> None:
        self._reasons: OrderedDict[str, CancelReason] = OrderedDict()

    def heard(self, message: Cancel) -> None:
        self._reasons[message.id] = message.reason
        if len(self._reasons) > REMEMBER_CANCELLED:
            self._reasons.popitem(last=False)

    def reason(self, request_id: str) -> CancelReason | None:
        return self._reasons.get(request_id) or self._reasons.get(client_id_of(request_id))


def generation_request(
    request: Request, request_id: str, resume_token_ids: tuple[int, ...] = (), resume_sent_chars: int | None = None
) -> GenerationRequest:
    """What the backend is asked for `request`, known in the pipeline as `request_id` (seeded by it)."""
    return GenerationRequest(
        request_id=request_id,
        messages=tuple(Message(m.role, m.content) for m in request.messages),
        prompt=request.prompt,
        max_tokens=request.sampling.max_tokens,
        temperature=request.sampling.temperature,
        top_p=request.sampling.top_p,
        stop=request.sampling.stop,
        seed=request.sampling.seed if request.sampling.seed is not None else stable_seed(request_id),
        resume_token_ids=resume_token_ids,
        resume_sent_chars=resume_sent_chars,
        tenant=request.tenant,
        priority=request.priority.value,
        stream=request.stream,
    )


def stable_seed(request_id: str) -> int:
    """A seed fixed by the request id: a redelivered or resumed request samples the same tokens, so
    a decode worker that takes over a stream reproduces what was already sent."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def to_wire(prefilled: Prefilled, worker: str) -> Prefill:
    return Prefill(
        handle=prefilled.handle,
        first_token_id=prefilled.first_token_id,
        first_text=prefilled.first_text,
        prompt_tokens=prefilled.prompt_tokens,
        worker=worker,
    )

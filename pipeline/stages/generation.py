"""What prefill and decode share: the request as the backend sees it, and the digest of a stream."""

from __future__ import annotations

import hashlib

from pipeline.backends.base import GenerationRequest, Message, Prefilled
from topics.envelope import Prefill
from topics.requests import Request


def generation_request(request: Request, resume_token_ids: tuple[int, ...] = ()) -> GenerationRequest:
    return GenerationRequest(
        request_id=request.id,
        messages=tuple(Message(m.role, m.content) for m in request.messages),
        prompt=request.prompt,
        max_tokens=request.sampling.max_tokens,
        temperature=request.sampling.temperature,
        top_p=request.sampling.top_p,
        stop=request.sampling.stop,
        seed=request.sampling.seed if request.sampling.seed is not None else stable_seed(request.id),
        resume_token_ids=resume_token_ids,
        tenant=request.tenant,
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
        finished=prefilled.finish_reason,
        worker=worker,
    )


def from_wire(prefill: Prefill) -> Prefilled:
    return Prefilled(
        handle=prefill.handle,
        first_token_id=prefill.first_token_id,
        first_text=prefill.first_text,
        prompt_tokens=prefill.prompt_tokens,
        finish_reason=prefill.finished,  # type: ignore[arg-type]
    )


def digest(parts: list[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
    return h.hexdigest()

"""What a request is to the cache: whether it may be cached, its exact key, and its semantic context.

The exact key is a digest of everything that changes the answer: the tenant, the model, the canonical
messages (or prompt), every field of `Sampling` (the whole struct, not a list of its fields), and the
task (`x-sluice-task`), which routing rules may send to other backends. `stream`, `priority`, ids and
deadlines are left out, so a streamed hit can answer a non-streamed request and a batch line an
interactive request's question (a rule that sends the batch lane elsewhere still serves the model the
client named). The semantic context is the same digest without the last user turn's text: a semantic
hit must match it exactly (same tenant, model, parameters, system prompt and earlier turns) and only
the last user turn may be a paraphrase.

Keys carry no text: `sluice:cache:<tenant digest>:<model digest>:<request digest>` (the prefix lets
`sluice cache purge` find a tenant's or a model's keys without knowing them).
"""

from __future__ import annotations

import hashlib

import msgspec

from pipeline.cache.config import Policy
from topics.requests import Request

PREFIX = "sluice:cache:"


def _digest(value: object) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(value)).hexdigest()


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scope(tenant: str, model: str | None = None) -> str:
    """The key prefix of a tenant's entries (of one model, if given)."""
    return f"{PREFIX}{_short(tenant)}:" + (f"{_short(model)}:" if model is not None else "")


def _parameters(request: Request) -> tuple[object, ...]:
    """Every field of `Sampling`, taken whole so that a field added to it later cannot be left out of the
    keys. The tuple encodes as the hand-written list it replaced did, so existing entries still match;
    adding (or reordering) a field changes every key once: a one-off flush, never a wrong answer."""
    return (*msgspec.structs.astuple(request.sampling), request.task)


def exact_key(tenant: str, request: Request) -> str:
    turns = tuple((m.role, m.content) for m in request.messages)
    return scope(tenant, request.model) + _digest(("exact", tenant, request.model, turns, request.prompt, _parameters(request)))


def last_turn(request: Request) -> str | None:
    """The text a semantic hit may paraphrase: the prompt, or the last message when it is the user's."""
    if request.prompt is not None:
        return request.prompt
    if request.messages and request.messages[-1].role == "user":
        return request.messages[-1].content
    return None


def context(tenant: str, request: Request) -> str:
    """Everything about the request but the last user turn's text."""
    earlier = tuple((m.role, m.content) for m in request.messages[:-1])
    kind = "completion" if request.prompt is not None else "chat"
    return _digest(("context", tenant, request.model, kind, earlier, _parameters(request)))


def refusal(request: Request, policy: Policy) -> str | None:
    """Why this request's answer may not be cached (None: it may)."""
    if not policy.enabled:
        return "disabled"
    s = request.sampling
    if s.temperature > 0 and s.seed is None and not policy.sampled:
        return "sampled"  # the client asked for a fresh draw each time
    return None

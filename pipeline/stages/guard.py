"""guard: the input guardrails, before any model is touched. First the cheap check: a prompt that
cannot fit its model's context is refused (400 `invalid_request`, `context_length: ...`) before any
guard work. Then PII by tenant policy (allow, redact with typed placeholders, or block) and prompt
injection (classifier plus patterns, threshold per tenant), over bounded pieces of the texts that a
queue shared fairly between tenants runs (so a tenant's 32 KB prompts do not hold up another's small
one). A refused request ends here with a 400 `content_filter` event whose message starts with the
reason (`prompt_injection`, `pii_blocked`, or `off_topic` when the route names the topics it serves
and the last user turn is far from all of them: on_topic.py); an admitted one goes on with its
sanitised text, and its `timings` carry the guard's own latency (`guard`, milliseconds from arrival
to verdict)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from pipeline.errors import StageError
from pipeline.guard.batcher import Batcher
from pipeline.guard.context_limit import ContextLimit
from pipeline.guard.errors import Reason
from pipeline.guard.injection import SEGMENT_CHARS
from pipeline.guard.loader import InputGuard
from pipeline.guard.memo import VerdictMemo
from pipeline.guard.on_topic import TopicScopes
from pipeline.guard.redact import Placeholders, apply_policy
from pipeline.guard.slices import PII_SLICE, Piece, PieceVerdict, TextCheck, TextVerdict, pieces_of, verdict_of
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch
from pipeline.topology import Topics
from topics.errors import ErrorCode
from topics.hops import Admitted
from topics.requests import Request


def checks_of(request: Request) -> list[TextCheck]:
    """Every message is checked for PII; user turns and completion prompts also for injection (system
    and assistant turns come from the calling service, not from its end user)."""
    checks = [TextCheck(m.content, m.role == "user") for m in request.messages]
    if request.prompt is not None:
        checks.append(TextCheck(request.prompt, True))
    return checks


class GuardStage:
    input_type = Admitted
    ordered = False

    def __init__(self, settings: Settings, guard: InputGuard, topics: Topics, name: str = "guard",
                 context: ContextLimit | None = None) -> None:
        self.name, self.topics = name, topics
        self._settings = settings.guard
        self._context = context if context is not None else ContextLimit.from_settings(settings.backends, settings.model_cache)
        # A batch holds one piece of a long text (a PII slice or an injection window), or short prompts
        # up to that much work: a request arriving behind a large one waits for one piece, not for it.
        # (A budget of a slice, a window and a short prompt measured 267 ms p50 for a small request
        # behind 4 x 32 KB; one piece keeps it under the 100 ms target. Bulk throughput pays.)
        budget = max(PII_SLICE, SEGMENT_CHARS)
        self._batcher: Batcher[Piece, PieceVerdict] = Batcher(guard.run, cost=Piece.cost, max_cost=budget)
        self._topics = TopicScopes(settings.guard.routes, guard.embedder) if settings.guard.routes else None
        self._memo = VerdictMemo(settings.guard.verdict_memo)  # pieces already judged are not screened again

    def sanitise(self, request: Request, verdicts: list[TextVerdict]) -> Request:
        """The request with PII redacted; raises StageError when a policy or the classifier refuses it."""
        threshold = self._settings.injection_threshold_for(request.tenant)  # ingest set it to the authenticated one
        if any(v.injection is not None and v.injection.score >= threshold for v in verdicts):
            raise StageError(ErrorCode.content_filter, f"{Reason.prompt_injection}: the input guard refused this request")
        policy = self._settings.policy(request.tenant)
        placeholders = Placeholders()
        texts = [m.content for m in request.messages] + ([request.prompt] if request.prompt is not None else [])
        redacted = [apply_policy(t, v.findings, policy, placeholders) for t, v in zip(texts, verdicts, strict=True)]
        blocked = sorted({e for r in redacted for e in r.blocked})
        if blocked:
            raise StageError(ErrorCode.content_filter, f"{Reason.pii_blocked}: the prompt contains {', '.join(blocked)}, which this tenant's policy refuses")
        if not any(r.redacted for r in redacted):
            return request
        messages = tuple(msgspec.structs.replace(m, content=r.text) for m, r in zip(request.messages, redacted))
        prompt = redacted[-1].text if request.prompt is not None else None
        return msgspec.structs.replace(request, messages=messages, prompt=prompt)

    async def verdicts(self, request: Request) -> list[TextVerdict]:
        checks = checks_of(request)
        pieces = [pieces_of(c) for c in checks]
        flat = [p for per_text in pieces for p in per_text]
        known = [self._memo.get(request.tenant, p) for p in flat]
        missing = [p for p, v in zip(flat, known, strict=True) if v is None]
        fresh = iter(await self._batcher.submit(request.tenant, missing) if missing else ())
        for i, piece in enumerate(flat):
            if known[i] is None:
                known[i] = verdict = next(fresh)
                self._memo.put(request.tenant, piece, verdict)
        results = iter(known)
        return [verdict_of(c, [next(results) for _ in per_text]) for c, per_text in zip(checks, pieces, strict=True)]

    async def check_topic(self, request: Request) -> None:
        """Refuses a request whose last user turn (or prompt) is far from every topic its route serves."""
        scope = self._topics.for_model(request.model) if self._topics else None
        users = [m.content for m in request.messages if m.role == "user"]
        text = request.prompt if request.prompt is not None else (users[-1] if users else "")
        if scope is not None and text and await asyncio.to_thread(scope.prompt_off_topic, text):
            raise StageError(ErrorCode.content_filter, f"{Reason.off_topic}: this route does not serve that topic")

    async def check_context(self, request: Request) -> None:
        """Off the event loop when the texts are long (tokenising 32 KB takes milliseconds)."""
        size = sum(len(m.content) for m in request.messages) + len(request.prompt or "")
        if size > PII_SLICE:
            await asyncio.to_thread(self._context.check, request)
        else:
            self._context.check(request)

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        clock = Stopwatch()
        await self.check_context(message.request)
        request = self.sanitise(message.request, await self.verdicts(message.request))
        await self.check_topic(message.request)
        timings = {**message.timings, self.name: clock.ms()}
        yield Out(self.topics.forward or "", message.id, msgspec.structs.replace(message, request=request, timings=timings))

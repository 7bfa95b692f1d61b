"""guard: the input guardrails, before any model is touched. PII by tenant policy (allow, redact with
typed placeholders, or block) and prompt injection (classifier plus patterns, threshold per tenant).
A refused request ends here with a 400 `content_filter` event whose message starts with the reason
(`prompt_injection`, `pii_blocked`); an admitted one goes on to route with its sanitised text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pipeline.errors import StageError
from pipeline.guard.batcher import Batcher
from pipeline.guard.errors import Reason
from pipeline.guard.loader import InputGuard, TextCheck, TextVerdict
from pipeline.guard.redact import Placeholders, apply_policy
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

    def __init__(self, settings: Settings, guard: InputGuard, topics: Topics, name: str = "guard") -> None:
        self.name, self.topics = name, topics
        self._settings = settings.guard
        self._batcher: Batcher[list[TextCheck], list[TextVerdict]] = Batcher(guard.check)

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

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        clock = Stopwatch()
        verdicts = await self._batcher.submit(checks_of(message.request))
        request = self.sanitise(message.request, verdicts)
        timings = {**message.timings, self.name: clock.ms()}
        yield Out(self.topics.forward or "", message.id, msgspec.structs.replace(message, request=request, timings=timings))

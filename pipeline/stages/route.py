"""route: chooses the backends for a request and sends it to the first one's pool, the others following
as its fallbacks.

Candidates: the first `[[routing.rules]]` entry that matches the request (model, task, detected
language, tenant, priority lane, prompt length, `max_tokens`) and has backends serving the request's
model names them (those backends only, in the rule's order: a rule never sends a request to another
model, whatever the client's task header says), else the backends serving the request's model. A rule's
cost ceiling refuses the request when its model costs more per 1K tokens, or has no price (fail closed);
its latency objective puts candidates whose reported time to first token meets it first.
`pipeline.routing.choose` orders the candidates by health (silent and ejected backends last resort
only), prefix affinity and load, from what every generation worker reports on `llm.backend.health`
(read whole: `on_table`) and what this process sent since (`HealthView.sent`).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import AsyncIterator

from pipeline.errors import StageError
from pipeline.observability import collectors
from pipeline.routing.affinity import PrefixAffinity
from pipeline.routing.choose import choose
from pipeline.routing.config import RouteRule
from pipeline.routing.health import HealthView
from pipeline.settings import BackendSettings, Settings
from pipeline.stage import Out, Stopwatch
from pipeline.topology import Topics
from topics.errors import ErrorCode
from topics.health import BackendHealth
from topics.hops import Admitted, Route, Routed, forward
from topics.requests import Request

LANGUAGE_CHARS = 1000  # the detector reads this much of the last user turn


class RouteStage:
    input_type = Admitted
    ordered = False
    table_type = BackendHealth  # llm.backend.health

    def __init__(self, settings: Settings, topics: Topics, name: str = "route", rng: random.Random | None = None) -> None:
        self.name, self.topics = name, topics
        self._backends: dict[str, BackendSettings] = {b.name: b for b in settings.backends}
        self._by_model: dict[str, list[str]] = {}
        for backend in settings.backends:
            self._by_model.setdefault(backend.model, []).append(backend.name)
        self._routing = settings.routing
        self._prices = settings.gateway.prices
        self.health = HealthView(settings.routing)
        collectors.watch_health(self.health, tuple(self._backends))  # sluice_backend_ejected at /metrics
        self._rng = rng or random.Random()
        self._affinity = PrefixAffinity(settings.routing)

    async def on_table(self, record: BackendHealth) -> None:
        if record.backend in self._backends:  # the configured ones only: a name of nothing would only grow the view
            self.health.apply(record)

    def choose(self, admitted: Admitted) -> Route:
        request = admitted.request
        prefix = _prefix(request)
        rule, names = self._candidates(admitted, prefix)
        if not names:
            raise StageError(ErrorCode.not_found, "no backend serves this model")
        if rule is not None and rule.max_cost_per_1k:
            names = [n for n in names if self._price(n) <= rule.max_cost_per_1k]
            if not names:
                raise StageError(ErrorCode.not_found, f"no backend of route {rule.name!r} is within its cost ceiling")
        now = time.time()
        members = {n: self.health.member(n, now) for n in names}
        objective = rule.ttft_p95_ms if rule is not None else 0.0
        ordered = choose(names, members, prefix, self._routing, objective, self._rng, self._affinity)
        first = self._backends[ordered[0]]
        self.health.sent(first.name)
        return Route(backend=first.name, pool=first.pool, fallbacks=tuple(ordered[1:]))

    def _candidates(self, admitted: Admitted, prefix: str) -> tuple[RouteRule | None, list[str]]:
        """The first matching rule with backends of the request's model, and those; else none and the model's."""
        model = admitted.request.model
        for rule in self._routing.rules:
            serving = [n for n in rule.backends if self._backends[n].model == model]
            if serving and _matches(rule, admitted.request, admitted.tenant, len(prefix)):
                return rule, serving
        return None, self._by_model.get(model, [])

    def _price(self, backend: str) -> float:
        """Per 1K tokens, prompt + completion; no price: infinite (settings refuse a ceiling over one)."""
        price = self._prices.get(self._backends[backend].model)
        return price.prompt_per_1k + price.completion_per_1k if price is not None else float("inf")

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        clock = Stopwatch()
        route = self.choose(message)
        routed = forward(message, Routed, route=route, timings={**message.timings, self.name: clock.ms()})
        yield Out(self.topics.pools[route.pool], message.id, routed)


def _prefix(request: Request) -> str:
    """The text a prompt starts with, for prefix affinity: system and earlier turns first."""
    if request.prompt is not None:
        return request.prompt
    return "\n".join(m.content for m in request.messages)


def _last_turn(request: Request) -> str:
    """The prompt, or the last user turn (not a system or assistant message after it): its language."""
    if request.prompt is not None:
        return request.prompt
    return next((m.content for m in reversed(request.messages) if m.role == "user"), "")


def _matches(rule: RouteRule, request: Request, tenant: str, chars: int) -> bool:
    checks = (
        not rule.models or request.model in rule.models,
        not rule.tasks or request.task in rule.tasks,
        not rule.tenants or tenant in rule.tenants,
        not rule.priority or request.priority.value == rule.priority,
        chars >= rule.min_prompt_chars,
        not rule.max_prompt_chars or chars <= rule.max_prompt_chars,
        request.sampling.max_tokens >= rule.min_max_tokens,
        not rule.max_max_tokens or request.sampling.max_tokens <= rule.max_max_tokens,
    )
    if not all(checks):
        return False
    return not rule.languages or language(_last_turn(request)[:LANGUAGE_CHARS]) in rule.languages


@functools.lru_cache(maxsize=4096)
def language(text: str) -> str:
    """The ISO 639-1 code of `text`'s language (py3langid: offline, its model ships in the package)."""
    import py3langid

    code, _ = py3langid.classify(text)
    return str(code)

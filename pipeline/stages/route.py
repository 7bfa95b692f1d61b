"""route: chooses the backend for a request from the config file and sends it to that backend's pool.

For now the rule is the model name; rules on task, language, length and cost, live health and
circuit breakers arrive with the routing issue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pipeline.errors import StageError
from pipeline.settings import BackendSettings, Settings
from pipeline.stage import Out, Stopwatch
from pipeline.topology import Topics
from topics.errors import ErrorCode
from topics.hops import Admitted, Route, Routed, forward


class RouteStage:
    input_type = Admitted
    ordered = False

    def __init__(self, settings: Settings, topics: Topics, name: str = "route") -> None:
        self.name, self.topics = name, topics
        self._by_model: dict[str, list[BackendSettings]] = {}
        for backend in settings.backends:
            self._by_model.setdefault(backend.model, []).append(backend)

    def choose(self, admitted: Admitted) -> Route:
        candidates = self._by_model.get(admitted.request.model)
        if not candidates:
            raise StageError(ErrorCode.not_found, "no backend serves this model")
        first, *rest = candidates
        return Route(backend=first.name, pool=first.pool, fallbacks=tuple(b.name for b in rest))

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        clock = Stopwatch()
        route = self.choose(message)
        routed = forward(message, Routed, route=route, timings={**message.timings, self.name: clock.ms()})
        yield Out(self.topics.pools[route.pool], message.id, routed)

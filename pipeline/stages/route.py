"""route: chooses the backend for a request from the config file and sends it to that backend's pool.

For now the rule is the model name; rules on task, language, length and cost, live health and
circuit breakers arrive with the routing issue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pipeline.errors import StageError
from pipeline.settings import BackendSettings, Settings
from pipeline.stage import Out, Stopwatch
from topics import registry
from topics.envelope import Envelope, Route
from topics.errors import ErrorCode


class RouteStage:
    name = "route"
    input_topics = (registry.GUARDED,)  # what guard passed
    input_type = Envelope
    ordered = False

    def __init__(self, settings: Settings) -> None:
        self._by_model: dict[str, list[BackendSettings]] = {}
        for backend in settings.backends:
            self._by_model.setdefault(backend.model, []).append(backend)

    def choose(self, envelope: Envelope) -> Route:
        candidates = self._by_model.get(envelope.request.model)
        if not candidates:
            raise StageError(ErrorCode.not_found, "no backend serves this model")
        first, *rest = candidates
        return Route(backend=first.name, pool=first.pool, fallbacks=tuple(b.name for b in rest))

    async def handle(self, message: Envelope) -> AsyncIterator[Out]:
        clock = Stopwatch()
        route = self.choose(message)
        timings = {**message.timings, self.name: clock.ms()}
        yield Out(registry.routed_topic(route.pool), message.request.id, msgspec.structs.replace(message, route=route, timings=timings))

"""A request its backend failed before the first token, sent on to the next backend of its route."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pipeline.settings import BackendSettings
from pipeline.stage import Out
from topics import registry
from topics.hops import Route, Routed


def rerouted(message: Routed, backends: Mapping[str, BackendSettings]) -> Out | None:
    """`message` addressed to its first fallback's pool, the rest of the fallbacks after it (None when
    none is left, or the message is past routing: a Prefilled continues on its own backend)."""
    if type(message) is not Routed or not message.route.fallbacks:
        return None
    following, *rest = message.route.fallbacks
    backend = backends.get(following)
    if backend is None:
        return None
    route = Route(backend=backend.name, pool=backend.pool, fallbacks=tuple(rest))
    return Out(registry.routed_topic(backend.pool), message.id, msgspec.structs.replace(message, route=route))

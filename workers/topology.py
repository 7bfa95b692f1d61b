"""The stages sluice runs, in pipeline order, and how each is built from settings.

    ingest -> llm.admitted -> guard -> llm.guarded -> route -> llm.routed.<pool> -> prefill
    -> llm.prefilled -> decode -> llm.tokens -> postguard -> llm.checked -> emit -> llm.responses.<name>
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeline.backends.base import Backend
from pipeline.gateway.build import redis_gateway
from pipeline.settings import Settings
from pipeline.stage import Stage
from pipeline.stages.decode import DecodeStage
from pipeline.stages.emit import EmitStage
from pipeline.stages.ingest import IngestStage
from pipeline.stages.prefill import PrefillStage
from pipeline.stages.route import RouteStage

Build = Callable[[Settings, Mapping[str, Backend]], list[Stage]]


def _prefill(settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    return [PrefillStage(backends[b.name], b.pool) for b in settings.backends if b.name in backends]


def _decode(settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    # One decode stage per process: it serves the first local backend (one backend for now).
    return [DecodeStage(next(iter(backends.values())))] if backends else []



# The guards import Presidio, spaCy and onnxruntime (seconds, hundreds of MB): only the processes that
# run a guard stage import them, and they load their models here, once per worker.
def _guard(settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    from pipeline.guard.loader import InputGuard
    from pipeline.stages.guard import GuardStage

    return [GuardStage(settings, InputGuard(settings.guard, settings.model_cache))]


def _postguard(settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    from pipeline.guard.loader import output_guard
    from pipeline.stages.postguard import PostguardStage

    return [PostguardStage(settings.guard, output_guard(settings.guard))]


STAGES: dict[str, Build] = {
    "ingest": lambda s, _: [IngestStage(s, redis_gateway(s))],
    "guard": _guard,
    "route": lambda s, _: [RouteStage(s)],
    "prefill": _prefill,
    "decode": _decode,
    "postguard": _postguard,
    "emit": lambda s, _: [EmitStage(s, meter=redis_gateway(s))],
}
NEEDS_BACKEND = frozenset({"prefill", "decode"})


def build(names: list[str], settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    return [stage for name in names for stage in STAGES[name](settings, backends)]

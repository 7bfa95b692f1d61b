"""The stages sluice runs, in pipeline order, and how each is built from settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeline.backends.base import Backend
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


STAGES: dict[str, Build] = {
    "ingest": lambda s, _: [IngestStage(s)],
    "route": lambda s, _: [RouteStage(s)],
    "prefill": _prefill,
    "decode": _decode,
    "emit": lambda s, _: [EmitStage(s)],
}
NEEDS_BACKEND = frozenset({"prefill", "decode"})


def build(names: list[str], settings: Settings, backends: Mapping[str, Backend]) -> list[Stage]:
    return [stage for name in names for stage in STAGES[name](settings, backends)]

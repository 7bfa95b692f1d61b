"""Builds the stage objects of the nodes a process runs (`pipeline.topology` says which and with which
topics). The guards import Presidio, spaCy and onnxruntime (seconds, hundreds of MB): only a process
that runs a guard stage imports them, and loads their models here, once."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping

from pipeline.backends.base import Backend
from pipeline.cache.exact import ExactTier, MemoryExactTier, RedisExactTier
from pipeline.gateway.build import redis_gateway, stage_redis
from pipeline.routing.stats import BackendStats
from pipeline.settings import BackendSettings, Settings
from pipeline.stage import Stage
from pipeline.state import MemoryStateStore, RedisStateStore, StateStore
from pipeline.state.metered import MeteredStore
from pipeline.topology import Node, graph, select


def nodes_of(settings: Settings, names: list[str] | None = None) -> list[Node]:
    """The deployment's nodes (its profile and pools), or those of them named (by kind or name)."""
    nodes = graph(settings.stages, settings.pools, settings.unsplit_pools)
    return nodes if names is None else select(nodes, names)


def state_store(settings: Settings, stage: str) -> StateStore:
    """The per-request state store of `stage`, counting its takeovers and fenced writes."""
    if settings.state.store == "memory":
        return MeteredStore(MemoryStateStore(settings.state.ttl_s), stage)
    return MeteredStore(RedisStateStore(stage_redis(settings), ttl_s=settings.state.ttl_s), stage)


def exact_tier(settings: Settings) -> ExactTier:
    """The cache's exact tier: Redis, or this process's memory when the state store is (a demo, tests)."""
    if settings.state.store == "memory":
        return _memory_exact()
    return RedisExactTier(stage_redis(settings))


@functools.cache
def _memory_exact() -> MemoryExactTier:
    return MemoryExactTier()  # one per process: emit writes what the cache stage reads


def _any_semantic(settings: Settings) -> bool:
    return any(t.semantic for t in settings.cache.tenants.values())


def _stats(config: BackendSettings, stage: str, settings: Settings) -> BackendStats:
    """What a generation stage reports of its backend; `worker` tells this process's stage from others."""
    worker = f"{stage}:{socket.gethostname()}:{os.getpid()}"
    return BackendStats(config.name, config.pool, worker, config.max_batch, settings.routing.eject_after,
                        routing=settings.routing)


def pool_backend(node: Node, settings: Settings, backends: Mapping[str, Backend]) -> Backend:
    for b in settings.backends:
        if b.pool == node.pool and b.name in backends:
            return backends[b.name]
    raise LookupError(f"no backend of pool {node.pool!r} is loaded in this process")


def build(nodes: list[Node], settings: Settings, backends: Mapping[str, Backend], *, worker: str = "0") -> list[Stage]:
    return [_build(node, settings, backends, worker) for node in nodes]


def _build(node: Node, settings: Settings, backends: Mapping[str, Backend], worker: str) -> Stage:
    from pipeline.stages.decode import DecodeStage
    from pipeline.stages.emit import EmitStage
    from pipeline.stages.ingest import IngestStage
    from pipeline.stages.prefill import PrefillStage
    from pipeline.stages.route import RouteStage

    t, name = node.topics, node.name
    if node.kind == "ingest":
        return IngestStage(settings, t, redis_gateway(settings), state_store(settings, name), name=name)
    if node.kind == "route":
        return RouteStage(settings, t, name=name)
    by_name = {b.name: b for b in settings.backends}
    if node.kind == "prefill":
        backend = pool_backend(node, settings, backends)
        return PrefillStage(backend, t, name=name, worker=worker, stats=_stats(by_name[backend.name], name, settings), backends=by_name)  # type: ignore[arg-type]
    if node.kind == "decode":
        backend = pool_backend(node, settings, backends)
        return DecodeStage(backend, t, state_store(settings, name), name=name, stats=_stats(by_name[backend.name], name, settings),  # type: ignore[arg-type]
                           backends=by_name, chunk_window_s=settings.runtime.chunk_window_ms / 1000)
    if node.kind == "generate":
        from pipeline.stages.generate import GenerateStage

        backend = pool_backend(node, settings, backends)
        return GenerateStage(backend, t, state_store(settings, name), name=name, stats=_stats(by_name[backend.name], name, settings),
                             backends=by_name, chunk_window_s=settings.runtime.chunk_window_ms / 1000,
                             chars_per_token=settings.gateway.chars_per_token)
    if node.kind == "emit":
        answers = exact_tier(settings) if t.table else None
        return EmitStage(settings, t, state_store(settings, name), meter=redis_gateway(settings), name=name, answers=answers)
    if node.kind == "cache":
        from pipeline.guard.embedder import load_embedder
        from pipeline.stages.cache import CacheStage

        embedder = load_embedder(settings.model_cache, threads=1) if settings.cache.semantic or _any_semantic(settings) else None
        return CacheStage(settings.cache, t, exact_tier(settings), embedder, state_store(settings, name), name=name)
    if node.kind == "guard":
        from pipeline.guard.loader import InputGuard
        from pipeline.stages.guard import GuardStage

        return GuardStage(settings, InputGuard(settings.guard, settings.model_cache), t, name=name)
    if node.kind == "postguard":
        from pipeline.guard.loader import output_guard
        from pipeline.stages.postguard import PostguardStage

        return PostguardStage(settings.guard, output_guard(settings.guard, settings.model_cache), t, state_store(settings, name), name=name)
    raise LookupError(f"no stage of kind {node.kind!r}")

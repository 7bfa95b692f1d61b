"""Metrics read at scrape time from objects that already know them: the engine's scheduler (running and
waiting sequences, KV blocks in use, as vLLM reports them; speculative draft tokens proposed and
accepted; batch-only steps stopped for interactive arrivals) and route's view of backend health
(which backends are ejected). Objects are held weakly: a closed engine or stage drops out of the output."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    def __init__(self) -> None:
        self._engines: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def add(self, name: str, engine: Any) -> None:
        self._engines[name] = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        running = GaugeMetricFamily("sluice_num_requests_running", "Sequences in the engine's running batch", labels=["engine"])
        waiting = GaugeMetricFamily("sluice_num_requests_waiting", "Sequences waiting for the engine's batch", labels=["engine"])
        kv = GaugeMetricFamily("sluice_kv_cache_usage_perc", "Share of the engine's KV-cache blocks in use (0 to 1)", labels=["engine"])
        spec = CounterMetricFamily("sluice_engine_spec_tokens", "Speculative draft tokens proposed and accepted",
                                   labels=["engine", "outcome"])
        stopped = CounterMetricFamily("sluice_engine_interrupted_steps",
                                      "Batch-only steps stopped for an arriving interactive request (their work is redone)",
                                      labels=["engine"])
        for name, engine in list(self._engines.items()):
            scheduler, blocks = engine.scheduler, engine.block_manager
            running.add_metric([name], len(scheduler.running))
            waiting.add_metric([name], len(scheduler.waiting))
            total = blocks.num_blocks
            kv.add_metric([name], (total - blocks.num_free_blocks) / total if total else 0.0)
            spec.add_metric([name, "proposed"], scheduler.spec_proposed)
            spec.add_metric([name, "accepted"], scheduler.spec_accepted)
            stopped.add_metric([name], engine.interrupted_steps)
        yield from (running, waiting, kv, spec, stopped)


class HealthCollector(Collector):
    def __init__(self) -> None:
        self._views: list[tuple[weakref.ref[Any], tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def add(self, view: Any, backends: tuple[str, ...]) -> None:
        with self._lock:
            self._views = [(ref, names) for ref, names in self._views if ref() is not None] + [(weakref.ref(view), backends)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ejected = GaugeMetricFamily("sluice_backend_ejected", "1 while route has ejected the backend (consecutive failures)",
                                    labels=["backend"])
        now, seen = time.time(), set()
        with self._lock:
            views = [(ref(), names) for ref, names in self._views]
        for view, names in views:
            for name in names:
                if view is not None and name not in seen:
                    seen.add(name)
                    ejected.add_metric([name], 1.0 if view.member(name, now).ejected else 0.0)
        yield ejected


ENGINES = EngineCollector()
HEALTH = HealthCollector()
REGISTRY.register(ENGINES)
REGISTRY.register(HEALTH)


def watch_engine(name: str, engine: Any) -> None:
    """Reports `engine` (an LLMEngine: `scheduler`, `block_manager`) as `name`, a configured backend."""
    ENGINES.add(name, engine)


def watch_health(view: Any, backends: tuple[str, ...]) -> None:
    """Reports, for each configured backend, whether `view` (route's HealthView) has it ejected."""
    HEALTH.add(view, backends)

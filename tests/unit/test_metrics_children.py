"""pipeline.metrics answers `labels()` from a dict: the same child as prometheus_client's, kept in step by
`remove` and `clear`, so what is exported is what prometheus_client alone would export."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pipeline.metrics import Counter, Gauge


def test_labels_returns_prometheus_clients_child_every_time() -> None:
    counter = Counter("t_children_total", "test", ["stage", "outcome"], registry=CollectorRegistry())
    first = counter.labels("emit", "ok")
    first.inc()
    assert counter.labels("emit", "ok") is first
    assert counter.labels(stage="emit", outcome="ok") is first  # by name: prometheus_client's own path
    assert counter.labels("emit", "ok")._value.get() == 1.0


def test_a_removed_series_starts_again_from_zero_and_is_exported_again() -> None:
    registry = CollectorRegistry()
    lag = Gauge("t_lag", "test", ["stage", "topic", "partition"], registry=registry)
    lag.labels("emit", "llm.stream", 3).set(7)
    lag.remove("emit", "llm.stream", "3")  # removed under its string form, set under an int
    assert b't_lag{partition="3"' not in generate_latest(registry)
    again = lag.labels("emit", "llm.stream", 3)
    assert again._value.get() == 0.0
    again.set(2)
    assert b't_lag{partition="3",stage="emit",topic="llm.stream"} 2.0' in generate_latest(registry)


def test_clear_forgets_every_child() -> None:
    registry = CollectorRegistry()
    counter = Counter("t_cleared_total", "test", ["stage"], registry=registry)
    counter.labels("route").inc(5)
    counter.clear()
    assert counter.labels("route")._value.get() == 0.0

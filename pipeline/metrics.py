"""Prometheus metrics, labelled by stage name. The runner and the bridge record them; handlers don't."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

MESSAGES = Counter("sluice_messages_total", "Messages a stage finished, by outcome", ["stage", "outcome"])
HANDLE_SECONDS = Histogram(
    "sluice_handle_seconds",
    "Time from a message's arrival at a stage until all its outputs are acknowledged",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
IN_FLIGHT = Gauge("sluice_in_flight", "Messages a stage is working on", ["stage"])
PRODUCED = Counter("sluice_produced_total", "Messages produced, by topic", ["stage", "topic"])
GATEWAY_DEGRADED = Counter(
    "sluice_gateway_degraded_total",
    "Gateway decisions taken without Redis (failure mode), by operation and decision",
    ["operation", "decision"],
)
CACHE_LOOKUPS = Counter(
    "sluice_cache_lookups_total",
    "Cache stage decisions, by result: hit_exact, hit_semantic, miss, bypass (no-cache or not cacheable), trap (a "
    "semantic candidate refused by the trap check)",
    ["result"],
)
CACHE_DEGRADED = Counter("sluice_cache_degraded_total", "Exact-tier operations skipped because Redis was away", ["operation"])
CACHE_ENTRIES = Gauge("sluice_cache_entries", "Entries in this worker's semantic index, over all tenants")

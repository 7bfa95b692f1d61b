"""Every Prometheus metric sluice exports, in one place (docs/operations.md lists them with their alerts).

Request-level names and buckets follow vLLM's (`vllm:time_to_first_token_seconds` is
`sluice_time_to_first_token_seconds` here, with the same buckets and the `model_name` label), so the
dashboards and habits of vLLM users carry over. Per-stage histograms are finer (from 1 ms): a hop costs
milliseconds, and vLLM's request buckets start at 0.3 s.

Labels are bounded: stage names, topics and partitions from the graph, configured models and backends,
enums (outcomes, error codes, guard reasons, cache tiers), and tenants only when configured
(`observability.costs.tenant_label`; any other tenant is "other"). Never a request id, a key or text.

The runner, emit, the SDK's request watch and the bridge record them; handlers don't.
"""

from __future__ import annotations

from typing import Any

import prometheus_client


class _Children:
    """`labels()` answered from a dict after the first call for a label set: prometheus_client's takes a
    lock and rebuilds the key on every call (about 1.2 µs; a request makes over a dozen). Labels are
    bounded (above), and so is the dict; `remove` and `clear` keep it in step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[object, ...], Any] = {}

    def labels(self, *values: object, **by_name: object) -> Any:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        try:
            return self._children[values]
        except KeyError:
            child = self._children[values] = super().labels(*values)  # type: ignore[misc]
            return child

    def remove(self, *values: object) -> None:
        gone = tuple(map(str, values))
        self._children = {key: child for key, child in self._children.items() if tuple(map(str, key)) != gone}
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._children = {}
        super().clear()  # type: ignore[misc]


class Counter(_Children, prometheus_client.Counter):
    pass


class Gauge(_Children, prometheus_client.Gauge):
    pass


class Histogram(_Children, prometheus_client.Histogram):
    pass


# vLLM's buckets (vllm/v1/metrics/loggers.py), kept identical so its dashboards' thresholds carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# --- per stage (the runner) ---
MESSAGES = Counter("sluice_messages_total", "Messages a stage finished, by outcome", ["stage", "outcome"])
HANDLE_SECONDS = Histogram(
    "sluice_handle_seconds",
    "Handler time: from the start of a message's handling at a stage until all its outputs are acknowledged",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
QUEUE_SECONDS = Histogram(
    "sluice_stage_queue_time_seconds",
    "Queue time: from a message's produce timestamp until its stage starts handling it (Kafka and the runner's queue)",
    ["stage"],
    buckets=STAGE_BUCKETS,
)
IN_FLIGHT = Gauge("sluice_in_flight", "Messages a stage is working on", ["stage"])
PRODUCED = Counter("sluice_produced_total", "Messages produced, by topic", ["stage", "topic"])
STATE_TAKEOVERS = Counter(
    "sluice_state_takeovers_total",
    "Requests a stage's worker took over from another worker of the stage (a kill, a rebalance, a paused worker)",
    ["stage"],
)
STATE_FENCED = Counter(
    "sluice_state_fenced_writes_total",
    "Per-request state writes refused because another worker of the stage had taken the request over",
    ["stage"],
)
PRODUCER_RENEWALS = Counter(
    "sluice_producer_renewals_total", "Kafka producers this process replaced because they stopped delivering",
)
CONSUMER_LAG = Gauge(
    "sluice_consumer_lag",
    "Messages on a stage's input partition not yet fetched by it (high watermark minus position)",
    ["stage", "topic", "partition"],
)

# --- per request, seen by the client (the SDK, hence the bridge): vLLM's names ---
TTFT = Histogram("sluice_time_to_first_token_seconds", "Time from sending a request to its first chunk",
                 ["model_name"], buckets=TTFT_BUCKETS)
ITL = Histogram("sluice_inter_token_latency_seconds", "Time between consecutive chunks of one answer",
                ["model_name"], buckets=ITL_BUCKETS)
E2E = Histogram("sluice_e2e_request_latency_seconds", "Time from sending a request to its terminal event",
                ["model_name"], buckets=REQUEST_BUCKETS)

# --- per finished request (emit: once per request, whoever sent it) ---
REQUESTS = Counter(
    "sluice_requests_total",
    "Finished requests by outcome: the finish reason (stop, length) of an answer, else the error code",
    ["model_name", "outcome"],
)
PROMPT_TOKENS = Counter("sluice_prompt_tokens_total", "Prompt tokens of finished requests", ["model_name"])
GENERATION_TOKENS = Counter("sluice_generation_tokens_total", "Completion tokens of finished requests", ["model_name"])
COST = Counter(
    "sluice_cost_total",
    "Spend of finished requests at the configured prices (gateway.prices), in the prices' currency units",
    ["tenant", "model_name"],
)
GUARD_REFUSALS = Counter(
    "sluice_guard_refusals_total",
    "Requests the input or output guard ended (content_filter), by reason",
    ["reason"],
)
GUARD_MEMO = Counter(
    "sluice_guard_verdict_memo_total",
    "Pieces of text the input guard looked up in its memo of verdicts (guard/memo.py), by result: hit, miss",
    ["result"],
)
RATE_LIMITED = Counter(
    "sluice_rate_limit_refusals_total",
    "Requests refused by a rate limit (429), by scope (key, tenant, ip, global) and resource (requests, tokens)",
    ["scope", "resource"],
)

# --- gateway, cache, routing, engine ---
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
CACHE_DEGRADED = Counter("sluice_cache_degraded_total", "Exact-tier operations skipped because Redis was away or refused them", ["operation"])
CACHE_ENTRIES = Gauge("sluice_cache_entries", "Entries in this worker's semantic index, over all tenants")
DEPENDENCY_UP = Gauge(
    "sluice_dependency_up", "Whether this process reached a dependency at its last probe (1) or not (0)", ["dependency"],
)

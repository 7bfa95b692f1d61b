"""What a finished request cost, and the metrics of its terminal event (emit calls both, once per request).

The cost is the one the gateway charges: prompt and completion tokens at `gateway.prices` for the
request's model, zero for a cache hit unless `cache.hit_billing = "full"`. It is set on the terminal
event the client gets (`Done.cost`, `Failed.cost`) and on the usage record (`UsageRecord.cost`).

The `tenant` label is bounded: a tenant configured under `[gateway.tenants.<name>]`, the anonymous
tenant, or one listed in `observability.tenant_labels`, else "other" (keys may name any tenant).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pipeline import metrics
from pipeline.gateway.config import ModelPrice
from pipeline.guard.errors import Reason
from topics.errors import ErrorCode
from topics.stream import Done, Failed, Usage

OTHER = "other"
_REASONS = frozenset(r.value for r in Reason)


def cost(prices: Mapping[str, ModelPrice], model: str, usage: Usage) -> float:
    price = prices.get(model)
    if price is None:
        return 0.0
    return round((usage.prompt_tokens * price.prompt_per_1k + usage.completion_tokens * price.completion_per_1k) / 1000, 9)


def priced(terminal: Done | Failed, prices: Mapping[str, ModelPrice], billed: Usage) -> Done | Failed:
    """The terminal event with its cost: `billed` is the usage charged (none for a free cache hit)."""
    return msgspec.structs.replace(terminal, cost=cost(prices, terminal.model, billed))


class TenantLabels:
    def __init__(self, configured: frozenset[str]) -> None:
        self._configured = configured

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self._configured else OTHER


def observe(terminal: Done | Failed, tenant: str, models: frozenset[str]) -> None:
    """Counts one finished request: outcome, tokens, cost, and why a guard or a limit ended it."""
    model = terminal.model if terminal.model in models else OTHER
    outcome = terminal.finish_reason.value if isinstance(terminal, Done) else terminal.code.value
    metrics.REQUESTS.labels(model, outcome).inc()
    metrics.PROMPT_TOKENS.labels(model).inc(terminal.usage.prompt_tokens)
    metrics.GENERATION_TOKENS.labels(model).inc(terminal.usage.completion_tokens)
    if terminal.cost:
        metrics.COST.labels(tenant, model).inc(terminal.cost)
    if isinstance(terminal, Failed):
        if terminal.code is ErrorCode.content_filter:
            reason = terminal.message.split(":", 1)[0]
            metrics.GUARD_REFUSALS.labels(reason if reason in _REASONS else OTHER).inc()
        elif terminal.code is ErrorCode.rate_limited and terminal.rate_limit is not None:
            metrics.RATE_LIMITED.labels(terminal.rate_limit.scope, terminal.rate_limit.resource).inc()

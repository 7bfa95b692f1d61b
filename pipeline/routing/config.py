"""`[routing]` and `[[routing.rules]]` in sluice.toml.

Rules are tried in order; the first that matches a request names its candidate backends (in order of
preference): those of its `backends` that serve the request's model, never another model's (a rule
with none for it does not match it). A request no rule matches is served by the backends of its model,
in config order. A field left empty (or 0) matches anything.

    [[routing.rules]]
    name = "code-to-the-big-pool"
    models = ["smollm2-135m-instruct"]
    tasks = ["code"]                 # the request's `task` (x-sluice-task header at the bridge)
    languages = ["en"]               # detected offline from the last user turn (py3langid)
    max_prompt_chars = 8000
    backends = ["gpu-a", "gpu-b", "local"]
    max_cost_per_1k = 0.5            # refused when the model's price is above this (every backend needs a price)
    ttft_p95_ms = 800                # candidates whose reported TTFT p95 meets it (or is unknown) first
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RouteRule:
    name: str
    backends: tuple[str, ...]
    models: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    priority: str = ""  # "interactive" or "batch"; empty: either
    min_prompt_chars: int = 0
    max_prompt_chars: int = 0
    min_max_tokens: int = 0
    max_max_tokens: int = 0
    max_cost_per_1k: float = 0.0  # prompt + completion price per 1K tokens of the candidate's model
    ttft_p95_ms: float = 0.0


@dataclass(frozen=True)
class RoutingSettings:
    eject_after: int = 5  # consecutive failures that eject a backend (Envoy's consecutive_5xx)
    ejection_s: float = 30.0  # ejected this long times the number of ejections (Envoy's base_ejection_time)
    max_ejection_s: float = 300.0
    health_stale_s: float = 5.0  # a report older than this says nothing
    affinity_chars: int = 1000  # the prompt's first characters (about 250 tokens) pick a preferred backend (0: off)
    affinity_min_chars: int = 256  # shorter prompts are spread by load only
    affinity_max_load: float = 1.25  # a prefix's backend is passed over above this times the mean share of traffic
    affinity_slack: int = 3  # requests of slack on that share, and running above the mean now that pass it over too
    rules: tuple[RouteRule, ...] = ()

    def term_s(self, ejections: int) -> float:
        """How long a backend's `ejections`-th ejection in a row lasts."""
        return min(self.ejection_s * ejections, self.max_ejection_s)

    def problems(self, models: Mapping[str, str], priced: Collection[str]) -> list[str]:
        """`models`: each backend's model, by backend name; `priced`: the models gateway.prices names."""
        found = []
        for rule in self.rules:
            if not rule.backends:
                found.append(f"routing rule {rule.name!r} names no backends")
            if unknown := sorted(set(rule.backends) - set(models)):
                found.append(f"routing rule {rule.name!r} names unknown backends {unknown}")
            served = {models[b] for b in rule.backends if b in models}
            if rule.models and served and not served & set(rule.models):
                found.append(f"routing rule {rule.name!r} can match no request: none of its backends serves {list(rule.models)}")
            for backend in (b for b in rule.backends if rule.max_cost_per_1k and b in models and models[b] not in priced):
                found.append(f"routing rule {rule.name!r} has a cost ceiling but backend {backend!r} serves "
                             f"{models[backend]!r}, which gateway.prices gives no price")
            if rule.priority not in ("", "interactive", "batch"):
                found.append(f"routing rule {rule.name!r}: priority must be interactive or batch")
        if self.eject_after < 1 or self.ejection_s <= 0:
            found.append("routing.eject_after must be at least 1 and routing.ejection_s positive")
        if not self.max_ejection_s >= self.ejection_s:  # the term is min(ejection_s * n, max_ejection_s): 0 never ejects
            found.append(f"routing.max_ejection_s ({self.max_ejection_s:g}) must be at least routing.ejection_s ({self.ejection_s:g})")
        if not self.health_stale_s > 0:  # 0: every report is stale, so no backend's load is ever known
            found.append(f"routing.health_stale_s must be positive, got {self.health_stale_s:g}")
        return found

"""The choice among a request's candidate backends, given what the health view says now.

1. Drop ejected candidates, and silent ones (they reported, then stopped: their workers may be gone,
   and their last report, often "idle", would draw the traffic) (all of them out: keep them all, as
   Envoy's panic threshold does: a request is better tried than refused); drop those over the rule's
   latency objective when another meets it.
2. Prefix affinity (`PrefixAffinity`, route's table of where each long prefix was placed): a long prompt
   goes to its prefix's backend, where its blocks are likely cached, while that backend carries no more
   than its share of the traffic.
3. Power of two choices: two candidates at random, the less loaded one wins.
The others follow as fallbacks, least loaded first: a failure before the first token moves the request on.
"""

from __future__ import annotations

import random

from pipeline.routing.affinity import PrefixAffinity
from pipeline.routing.config import RoutingSettings
from pipeline.routing.health import Member


def choose(
    candidates: list[str], members: dict[str, Member], prefix: str, settings: RoutingSettings,
    ttft_objective_ms: float = 0.0, rng: random.Random | None = None, affinity: PrefixAffinity | None = None,
) -> list[str]:
    """`candidates` (backend names, in preference order) ordered for this request: the chosen first.
    Without `affinity`, load alone decides."""
    rng = rng or random.Random()
    healthy = [c for c in candidates if not (members[c].ejected or members[c].silent)]
    healthy = healthy or [c for c in candidates if not members[c].ejected] or list(candidates)
    if ttft_objective_ms:
        meeting = [c for c in healthy if not members[c].ttft_p95_ms or members[c].ttft_p95_ms <= ttft_objective_ms]
        healthy = meeting or healthy
    if len(healthy) == 1:
        return healthy
    load = {c: members[c].load for c in healthy}
    first = affinity.preferred(healthy, members, prefix) if affinity is not None else None
    if first is None:
        a, b = rng.sample(healthy, 2)
        first = a if load[a] <= load[b] else b
    if affinity is not None:
        affinity.record(first)
    rest = sorted((c for c in healthy if c != first), key=lambda c: (load[c], healthy.index(c)))
    return [first, *rest]

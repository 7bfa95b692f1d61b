"""The order of a request's candidate backends, given what the health view says now. It orders and never
drops: every candidate stays on the list, so a failure before the first token moves the request on to
the next one while any is left.

1. Tiers: healthy candidates that meet the rule's latency objective (or report no time to first token
   yet), the other healthy ones, the silent ones (they reported, then stopped: their workers may be gone,
   and their last report, often "idle", would draw the traffic), the ejected ones last (when every
   candidate is out, the first is still tried, as Envoy's panic threshold does: a request is better tried
   than refused).
2. The first choice, among the first tier that has any: prefix affinity (`PrefixAffinity`, route's table
   of where each long prefix was placed) sends a long prompt to its prefix's backend, where its blocks are
   likely cached, while that backend carries no more than its share of the traffic; else power of two
   choices: two candidates at random, the less loaded one wins.
3. The others follow as fallbacks, tier by tier, least loaded first within a tier.
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
    """`candidates` (backend names, in preference order) ordered for this request: the chosen first, then
    every other one. Without `affinity`, load alone decides."""
    rng = rng or random.Random()
    tiers = [tier for tier in _tiers(candidates, members, ttft_objective_ms) if tier]
    pool, first = tiers[0], tiers[0][0]
    if len(pool) > 1:
        preferred = affinity.preferred(pool, members, prefix) if affinity is not None else None
        if preferred is None:
            a, b = rng.sample(pool, 2)
            preferred = a if members[a].load <= members[b].load else b
        first = preferred
        if affinity is not None:
            affinity.record(first)
    rest = [c for tier in tiers for c in sorted(tier, key=lambda c: (members[c].load, candidates.index(c))) if c != first]
    return [first, *rest]


def _tiers(candidates: list[str], members: dict[str, Member], objective_ms: float) -> list[list[str]]:
    """Candidates in the order of step 1, each tier in `candidates`' order."""
    healthy = [c for c in candidates if not (members[c].ejected or members[c].silent)]
    meeting = [c for c in healthy if not objective_ms or not members[c].ttft_p95_ms or members[c].ttft_p95_ms <= objective_ms]
    silent = [c for c in candidates if members[c].silent and not members[c].ejected]
    return [meeting, [c for c in healthy if c not in meeting], silent, [c for c in candidates if members[c].ejected]]

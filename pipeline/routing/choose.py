"""The choice among a request's candidate backends, given what the health view says now.

1. Drop ejected candidates (all of them ejected: keep them all, as Envoy's panic threshold does:
   a request is better tried than refused); drop those over the rule's latency objective when another
   meets it.
2. Prefix affinity: a long prompt goes to the candidate that its first characters hash to (rendezvous
   hashing, so adding a backend moves only its share), where its prefix is likely cached, unless that
   candidate's load is over `affinity_max_load` times the mean: then load decides.
3. Power of two choices: two candidates at random, the less loaded one wins.
The others follow as fallbacks, least loaded first: a failure before the first token moves the request on.
"""

from __future__ import annotations

import hashlib
import math
import random

from pipeline.routing.config import RoutingSettings
from pipeline.routing.health import Member


def choose(
    candidates: list[str], members: dict[str, Member], prefix: str, settings: RoutingSettings,
    ttft_objective_ms: float = 0.0, rng: random.Random | None = None,
) -> list[str]:
    """`candidates` (backend names, in preference order) ordered for this request: the chosen first."""
    rng = rng or random.Random()
    healthy = [c for c in candidates if not members[c].ejected] or list(candidates)
    if ttft_objective_ms:
        meeting = [c for c in healthy if not members[c].ttft_p95_ms or members[c].ttft_p95_ms <= ttft_objective_ms]
        healthy = meeting or healthy
    if len(healthy) == 1:
        return healthy
    load = {c: members[c].load for c in healthy}
    first = _affine(healthy, members, prefix, settings)
    if first is None:
        a, b = rng.sample(healthy, 2)
        first = a if load[a] <= load[b] else b
    rest = sorted((c for c in healthy if c != first), key=lambda c: (load[c], healthy.index(c)))
    return [first, *rest]


def _affine(healthy: list[str], members: dict[str, Member], prefix: str, settings: RoutingSettings) -> str | None:
    """Consistent hashing with bounded loads (Mirrokni et al.): the candidates in the order the prefix
    hashes them to, the first that would hold, with this request, at most ceil(`affinity_max_load` x the
    mean) requests; so a popular prefix spills over to its second choice, which then caches it too,
    instead of piling onto one backend."""
    if not settings.affinity_chars or len(prefix) < settings.affinity_min_chars:
        return None
    key = prefix[: settings.affinity_chars].encode()
    ranked = sorted(healthy, key=lambda c: hashlib.blake2b(key + b"\0" + c.encode(), digest_size=8).digest(), reverse=True)
    if any(members[c].unit == 0 for c in healthy):  # capacities unknown: compare the loads themselves
        mean = sum(members[c].load for c in healthy) / len(healthy)
        return next((c for c in ranked if mean == 0 or members[c].load <= settings.affinity_max_load * mean), None)
    running = {c: round(members[c].load / members[c].unit) for c in healthy}
    bound = math.ceil(settings.affinity_max_load * (sum(running.values()) + 1) / len(healthy))
    return next((c for c in ranked if running[c] + 1 <= bound), None)

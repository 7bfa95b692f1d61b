"""Prefix affinity: a long prompt goes to a backend that its prefix was placed on, where its KV blocks
are likely cached, as long as that backend is not carrying more than its share.

A prefix (the prompt's first `affinity_chars` characters, kept only as a digest) seen for the first time
is placed on the candidate that this route process has sent the least traffic to lately (a decayed count
of its own choices), so prefixes spread evenly and the backends' caches do not all hold every prefix.
Later requests with that prefix go to the backend it was placed on unless that backend has lately taken
more than `affinity_max_load` times the mean share of traffic (give or take `affinity_slack` requests,
so that a few requests do not decide), or runs more than `affinity_slack` requests above the mean now
(from the health reports); then the prefix is placed on one more backend, the one of the others with
the least recent traffic, and its requests go to whichever of its backends has had the least traffic
and is within its share. A prefix that alone is more than one backend's share so ends up on several;
the others stay on one. Balance over time comes from where new prefixes and one-off prompts are placed, so a burst does not
scatter a prefix over every cache (what a bound on the momentary load alone did: docs/benchmarks.md).

The table is per route process: with several, each places prefixes on its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pipeline.routing.config import RoutingSettings
from pipeline.routing.health import Member

TABLE_SIZE = 4096  # prefixes remembered (least recently used forgotten first)
DECAY = 0.99  # per choice: the traffic count looks back over about the last 100 requests


class PrefixAffinity:
    def __init__(self, settings: RoutingSettings) -> None:
        self._settings = settings
        self._owner: OrderedDict[bytes, list[str]] = OrderedDict()
        self._traffic: dict[str, float] = {}

    def preferred(self, healthy: list[str], members: dict[str, Member], prefix: str) -> str | None:
        """The backend for this prefix (placing it as needed), or None for a short prompt."""
        s = self._settings
        if not s.affinity_chars or len(prefix) < s.affinity_min_chars:
            return None
        key = hashlib.blake2b(prefix[: s.affinity_chars].encode(), digest_size=16).digest()
        placed = self._owner.get(key, [])
        within = [c for c in placed if c in healthy and self._within_share(c, healthy, members)]
        if within:
            chosen = min(within, key=lambda c: (self._traffic.get(c, 0.0), healthy.index(c)))
        else:  # placed nowhere yet, or everywhere it is placed is over its share: one more backend
            spare = [c for c in healthy if c not in placed] or healthy
            chosen = min(spare, key=lambda c: (self._traffic.get(c, 0.0), members[c].load, healthy.index(c)))
            placed = placed if chosen in placed else [*placed, chosen]
        self._owner[key] = placed
        self._owner.move_to_end(key)
        if len(self._owner) > TABLE_SIZE:
            self._owner.popitem(last=False)
        return chosen

    def record(self, chosen: str) -> None:
        """Counts a choice (every one, affine or not), so that the shares reflect all the traffic sent."""
        for c in self._traffic:
            self._traffic[c] *= DECAY
        self._traffic[chosen] = self._traffic.get(chosen, 0.0) + 1.0

    def _within_share(self, owner: str, healthy: list[str], members: dict[str, Member]) -> bool:
        s, n = self._settings, len(healthy)
        mean_traffic = sum(self._traffic.get(c, 0.0) for c in healthy) / n
        if self._traffic.get(owner, 0.0) + 1 > s.affinity_max_load * (mean_traffic + 1 / n) + s.affinity_slack:
            return False
        if any(members[c].unit == 0 for c in healthy):  # capacities unknown: compare the loads themselves
            mean = sum(members[c].load for c in healthy) / n
            return mean == 0 or members[owner].load <= s.affinity_max_load * mean
        running = {c: members[c].load / members[c].unit for c in healthy}
        return running[owner] + 1 <= (sum(running.values()) + 1) / n + s.affinity_slack

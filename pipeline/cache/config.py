"""`[cache]` in sluice.toml: what the cache stage may answer and store, per tenant and per model.

    [cache]                         defaults for every tenant and model
    [cache.models."<model>"]        a route's TTL and semantic threshold
    [cache.tenants.<tenant>]        a tenant's switches and threshold (a tenant's setting wins)

`Policy` is the one resolved view the stage and emit use for a request.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_THRESHOLD = 0.82  # picked on the validation half of fow-cache's pairs (docs/caching.md, bench/cache_pairs.py)
# The longest an answer may be kept: the retention of `llm.cache.entries` (topics/registry.py), which the
# semantic tier is rebuilt from, so an entry never outlives its record. Also what emit stores under at most
# (a ticket's TTL is checked against it) and Redis is asked to keep a key for.
MAX_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ModelCache:
    ttl_s: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class TenantCache:
    enabled: bool | None = None
    semantic: bool | None = None
    threshold: float | None = None
    sampled: bool | None = None  # also cache answers sampled at temperature > 0 without a seed


@dataclass(frozen=True)
class Policy:
    enabled: bool
    semantic: bool
    threshold: float  # cosine similarity of the last user turns at or above which a semantic hit is served
    ttl_s: float
    sampled: bool


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = True
    semantic: bool = True
    threshold: float = DEFAULT_THRESHOLD
    ttl_s: float = 3600.0
    sampled: bool = False  # temperature > 0 without a seed asks for a new answer each time: not cached
    max_entry_bytes: int = 65536  # answers longer than this are not stored
    max_entries_per_tenant: int = 100_000  # the semantic index of one tenant; the oldest go first
    max_index_bytes: int = 256 * 2**20  # every tenant's semantic index in one cache worker, estimated; the oldest go first
    hit_billing: Literal["none", "full"] = "none"  # none: a hit charges no tokens or spend (it counts as a request)
    models: dict[str, ModelCache] = field(default_factory=dict)
    tenants: dict[str, TenantCache] = field(default_factory=dict)

    def policy(self, tenant: str, model: str) -> Policy:
        t = self.tenants.get(tenant, TenantCache())
        m = self.models.get(model, ModelCache())
        return Policy(
            enabled=self.enabled if t.enabled is None else t.enabled,
            semantic=self.semantic if t.semantic is None else t.semantic,
            threshold=t.threshold if t.threshold is not None else m.threshold if m.threshold is not None else self.threshold,
            ttl_s=m.ttl_s if m.ttl_s is not None else self.ttl_s,
            sampled=self.sampled if t.sampled is None else t.sampled,
        )

    def problems(self, models: Collection[str] | None = None) -> list[str]:
        """`models`: the configured ones, which every [cache.models] key must name (a typo's TTL and
        threshold would apply to nothing); None: not checked."""
        found = []
        if models is not None and (unknown := sorted(set(self.models) - set(models))):
            found.append(f"cache.models: {unknown} are not configured models ({', '.join(models)})")
        thresholds = [("cache.threshold", self.threshold)]
        thresholds += [(f"cache.models.{k}.threshold", v.threshold) for k, v in self.models.items() if v.threshold is not None]
        thresholds += [(f"cache.tenants.{k}.threshold", v.threshold) for k, v in self.tenants.items() if v.threshold is not None]
        found += [f"{name} must be in (0, 1], got {value}" for name, value in thresholds if not 0 < value <= 1]
        ttls = [("cache.ttl_s", self.ttl_s)] + [(f"cache.models.{k}.ttl_s", v.ttl_s) for k, v in self.models.items() if v.ttl_s is not None]
        found += [f"{name} must be positive and at most {MAX_TTL_S:g} s (7 days: llm.cache.entries' retention), "
                  f"got {value}" for name, value in ttls if not 0 < value <= MAX_TTL_S]  # NaN and inf too
        if min(self.max_entry_bytes, self.max_entries_per_tenant, self.max_index_bytes) < 1:
            found.append("cache.max_entry_bytes, cache.max_entries_per_tenant and cache.max_index_bytes must be at least 1")
        return found

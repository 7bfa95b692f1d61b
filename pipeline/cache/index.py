"""The semantic tier: one vector index per tenant (usearch, cosine, float16), in each cache worker's
memory, built from `llm.cache.entries` (compacted), so every replica holds the same entries and a
restart rebuilds them.

A candidate answers a request only when it is the same tenant's (the index is the tenant's own), for
the same model and semantic context (parameters, system prompt, earlier turns: `keys.context`), not
expired, at or above the similarity threshold, and the trap check finds nothing that the two questions
disagree on (`traps.conflicts`: numbers, names, negations, substituted words).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import numpy as np
from usearch.index import Index

from pipeline import metrics
from pipeline.cache.traps import Salient, conflicts
from pipeline.guard.embedder import DIMS
from topics.cache import Entry, Purge

CANDIDATES = 16  # nearest entries examined per lookup
_salient = msgspec.msgpack.Decoder(Salient)


def _readable(entry: Entry) -> bool:
    """Whether a lookup can use the entry: a vector of the model's size with finite values, a summary
    that decodes, an ending a hit can replay. One that cannot (the topic is compacted and replayed at
    every start) made every lookup that reached it fail as `internal` until it expired."""
    if not entry.vector or len(entry.vector) != DIMS * 2 or entry.finish_reason not in ("stop", "length"):
        return False
    try:
        _salient.decode(entry.salient)
    except msgspec.DecodeError:
        return False
    return bool(np.isfinite(to_vector(entry.vector)).all())


def to_vector(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.float16).astype(np.float32)


def from_vector(vector: np.ndarray) -> bytes:
    return vector.astype(np.float16).tobytes()


@dataclass
class _TenantIndex:
    index: Index = field(default_factory=lambda: Index(ndim=DIMS, metric="cos", dtype="f16"))
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # oldest first
    ids: dict[str, int] = field(default_factory=dict)  # exact key -> index id

    def remove(self, ident: int) -> None:
        entry = self.entries.pop(ident)
        self.ids.pop(entry.key, None)
        self.index.remove(ident)


@dataclass(frozen=True)
class Found:
    entry: Entry
    similarity: float


class SemanticIndex:
    def __init__(self, max_per_tenant: int = 100_000) -> None:
        self._tenants: dict[str, _TenantIndex] = {}
        self._purged: dict[tuple[str, str | None], float] = {}  # (tenant, model or None) -> purged up to
        self._max = max_per_tenant
        self._next_id = 1

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._tenants.values())

    def apply(self, record: Entry | Purge) -> None:
        """One record of `llm.cache.entries`, in any order relative to the others."""
        if isinstance(record, Purge):
            self._purge(record)
        elif _readable(record) and not self._was_purged(record):
            self._add(record)

    def search(self, tenant: str, model: str, context: str, vector: np.ndarray, salient: Salient, threshold: float) -> Found | None:
        index = self._tenants.get(tenant)
        if index is None or not index.entries:
            return None
        matches = index.index.search(vector, min(CANDIDATES, len(index.entries)))
        now = time.time()
        for ident, distance in zip(matches.keys.tolist(), matches.distances.tolist(), strict=True):
            similarity = 1.0 - float(distance)
            if similarity < threshold:
                break  # nearest first: the rest are further
            entry = index.entries.get(ident)
            if entry is None:
                continue
            if entry.expires_at <= now:
                index.remove(ident)
                continue
            if entry.model != model or entry.context != context:
                continue
            if conflicts(salient, _salient.decode(entry.salient)):
                metrics.CACHE_LOOKUPS.labels("trap").inc()  # a near neighbour the check refused
                continue
            return Found(entry, similarity)
        return None

    def _add(self, entry: Entry) -> None:
        index = self._tenants.setdefault(entry.tenant, _TenantIndex())
        if (old := index.ids.get(entry.key)) is not None:
            index.remove(old)
        ident, self._next_id = self._next_id, self._next_id + 1
        index.index.add(ident, to_vector(entry.vector))
        index.entries[ident] = entry
        index.ids[entry.key] = ident
        while len(index.entries) > self._max:
            index.remove(next(iter(index.entries)))

    def _was_purged(self, entry: Entry) -> bool:
        at = max(self._purged.get((entry.tenant, None), 0.0), self._purged.get((entry.tenant, entry.model), 0.0))
        return entry.stored_at <= at

    def _purge(self, purge: Purge) -> None:
        scope = (purge.tenant, purge.model)
        self._purged[scope] = max(self._purged.get(scope, 0.0), purge.at)
        index = self._tenants.get(purge.tenant)
        if index is None:
            return
        doomed = [i for i, e in index.entries.items() if e.stored_at <= purge.at and purge.model in (None, e.model)]
        for ident in doomed:
            index.remove(ident)

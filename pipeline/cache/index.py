"""The semantic tier: one vector index per tenant (usearch, cosine, float16), in each cache worker's
memory, built from `llm.cache.entries` (compacted), so every replica holds the same entries and a
restart rebuilds them.

A candidate answers a request only when it is the same tenant's (the index is the tenant's own), for
the same model and semantic context (parameters, system prompt, earlier turns: `keys.context`), not
expired, at or above the similarity threshold, and the trap check finds nothing that the two questions
disagree on (`traps.conflicts`: numbers, names, negations, substituted words).

Memory is bounded three ways, since the topic is replayed from its start (7 days) and tenant names can
come from JWT claims: an entry already expired is never added; expired entries are swept, soonest
expiry first, a few per `apply` and per `search` (a lookup's cost stays one vector search); and past
`max_per_tenant` entries in a tenant, or `max_bytes` (an estimate: `footprint`) over every tenant, the
oldest entries go. A tenant left with no entry is dropped with its index.

What the topic says is checked, since anyone who may write it could put anything there: an entry whose
key is not in its own tenant and model's scope (`keys.scope`), or that would live past MAX_TTL_S, is not
added. A purge counts from its `at` or from now, whichever is earlier (one dated in the future turned a
tenant's semantic cache off until a restart), and its mark is kept only MAX_TTL_S: whatever was stored
before the mark has expired by then, so the marks stay as few as the purges of the last 7 days.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
from usearch.index import Index

from pipeline import metrics
from pipeline.cache.config import MAX_TTL_S
from pipeline.cache.keys import scope
from pipeline.cache.traps import Salient, conflicts
from pipeline.guard.embedder import DIMS
from topics.cache import Entry, Purge

CANDIDATES = 16  # nearest entries examined per lookup
SWEEP = 16  # expired entries looked at per apply or search, at most: a few microseconds each
# What an entry costs beyond its own fields: usearch's copy of the vector and its graph links (1.7 KB
# an entry at 10,000 entries, `Index.memory_usage`) and this module's dict slots.
INDEXED_BYTES = 2048
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


def _valid(entry: Entry) -> bool:
    """Whether the entry is what emit stores: a key in its own tenant and model's scope (not another
    tenant's, not an arbitrary string) and a lifetime within MAX_TTL_S (which purge marks rely on; a second
    more for the rounding of `stored_at + ttl_s`)."""
    lifetime = entry.expires_at - entry.stored_at
    return entry.key.startswith(scope(entry.tenant, entry.model)) and lifetime <= MAX_TTL_S + 1.0


def footprint(entry: Entry) -> int:
    """About what an entry holds in memory, in bytes: its answer, vector, summary and keys as Python
    objects (each chunk an object of its own) and its place in the index."""
    fields = (entry.key, entry.tenant, entry.model, entry.context, entry.chunks, entry.vector, entry.salient)
    return sum(map(sys.getsizeof, fields)) + sum(map(sys.getsizeof, entry.chunks)) + INDEXED_BYTES


def to_vector(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.float16).astype(np.float32)


def from_vector(vector: np.ndarray) -> bytes:
    return vector.astype(np.float16).tobytes()


@dataclass
class _TenantIndex:
    index: Index = field(default_factory=lambda: Index(ndim=DIMS, metric="cos", dtype="f16"))
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # oldest first
    ids: dict[str, int] = field(default_factory=dict)  # exact key -> index id


@dataclass(frozen=True)
class Found:
    entry: Entry
    similarity: float


class SemanticIndex:
    def __init__(
        self, max_per_tenant: int = 100_000, max_bytes: int = 256 * 2**20, clock: Callable[[], float] = time.time,
    ) -> None:
        self._tenants: dict[str, _TenantIndex] = {}
        self._purged: dict[tuple[str, str | None], float] = {}  # (tenant, model or None) -> purged up to
        self._max = max_per_tenant
        self._max_bytes = max_bytes
        self._clock = clock  # the wall clock `Entry.expires_at` is on
        self._next_id = 1
        self._order: OrderedDict[int, str] = OrderedDict()  # every entry's id -> its tenant, oldest first
        self._expiry: list[tuple[float, int]] = []  # heap of (expires_at, id); ids no longer held are skipped
        self._bytes = 0  # footprint() of every entry held

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        """The estimated memory of every entry held (`footprint`), which `max_bytes` bounds."""
        return self._bytes

    def apply(self, record: Entry | Purge) -> None:
        """One record of `llm.cache.entries`, in any order relative to the others."""
        now = self._clock()
        self._sweep(now)
        if isinstance(record, Purge):
            self._purge(record, now)
        elif record.expires_at > now and _valid(record) and _readable(record) and not self._was_purged(record):
            self._add(record)

    def search(self, tenant: str, model: str, context: str, vector: np.ndarray, salient: Salient, threshold: float) -> Found | None:
        now = self._clock()
        self._sweep(now)
        index = self._tenants.get(tenant)
        if index is None or not index.entries:
            return None
        matches = index.index.search(vector, min(CANDIDATES, len(index.entries)))
        for ident, distance in zip(matches.keys.tolist(), matches.distances.tolist(), strict=True):
            similarity = 1.0 - float(distance)
            if similarity < threshold:
                break  # nearest first: the rest are further
            entry = index.entries.get(ident)
            if entry is None:
                continue
            if entry.expires_at <= now:
                self._drop(ident)
                continue
            if entry.model != model or entry.context != context:
                continue
            if conflicts(salient, _salient.decode(entry.salient)):
                metrics.CACHE_LOOKUPS.labels("trap").inc()  # a near neighbour the check refused
                continue
            return Found(entry, similarity)
        return None

    def _add(self, entry: Entry) -> None:
        if (held := self._tenants.get(entry.tenant)) is not None and (old := held.ids.get(entry.key)) is not None:
            self._drop(old)  # the same key stored again: the later record wins
        index = self._tenants.setdefault(entry.tenant, _TenantIndex())
        ident, self._next_id = self._next_id, self._next_id + 1
        index.index.add(ident, to_vector(entry.vector))
        index.entries[ident] = entry
        index.ids[entry.key] = ident
        self._order[ident] = entry.tenant
        self._bytes += footprint(entry)
        heapq.heappush(self._expiry, (entry.expires_at, ident))
        while len(index.entries) > self._max:
            self._drop(next(iter(index.entries)))
        while self._bytes > self._max_bytes and self._order:
            self._drop(next(iter(self._order)))
        if len(self._expiry) > 2 * len(self._order) + 1024:  # mostly ids dropped before they expired
            self._expiry = [(t.entries[i].expires_at, i) for t in self._tenants.values() for i in t.entries]
            heapq.heapify(self._expiry)

    def _sweep(self, now: float) -> None:
        """Drops expired entries, soonest expiry first, looking at SWEEP of them at most."""
        for _ in range(SWEEP):
            if not self._expiry or self._expiry[0][0] > now:
                return
            _, ident = heapq.heappop(self._expiry)
            if ident in self._order:
                self._drop(ident)

    def _drop(self, ident: int) -> None:
        tenant = self._order.pop(ident)
        index = self._tenants[tenant]
        entry = index.entries.pop(ident)
        if index.ids.get(entry.key) == ident:
            del index.ids[entry.key]
        index.index.remove(ident)
        self._bytes -= footprint(entry)
        if not index.entries:
            del self._tenants[tenant]

    def _was_purged(self, entry: Entry) -> bool:
        at = max(self._purged.get((entry.tenant, None), 0.0), self._purged.get((entry.tenant, entry.model), 0.0))
        return entry.stored_at <= at

    def _purge(self, purge: Purge, now: float) -> None:
        at = min(purge.at, now)  # one dated in the future refused every entry of its scope until a restart
        horizon = now - MAX_TTL_S  # whatever was stored before a mark this old has expired: the mark can go
        self._purged = {s: t for s, t in self._purged.items() if t > horizon}
        if at > horizon:
            marked = (purge.tenant, purge.model)
            self._purged[marked] = max(self._purged.get(marked, 0.0), at)
        index = self._tenants.get(purge.tenant)
        if index is None:
            return
        doomed = [i for i, e in index.entries.items() if e.stored_at <= at and purge.model in (None, e.model)]
        for ident in doomed:
            self._drop(ident)

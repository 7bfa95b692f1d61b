"""The exact tier: an answer per exact key (pipeline.cache.keys), in Redis, each with its TTL.

Every key expires (Redis' `volatile-*` eviction may drop any of them first), within `config.MAX_TTL_S`.
A cache that cannot reach Redis, or that Redis refuses (an error reply: READONLY after a failover, OOM,
NOPERM), answers nothing and stores nothing: a miss costs a generation, never a wrong or a late answer,
so `get` and `put` never raise for Redis (they count it in a metric and log a warning). A refusal that
escaped `put` once reached the client as a second terminal event after its answer (emit stores after it
sent the `Done`; docs/reliability.md).
`MemoryExactTier` is the same for one process (unit tests, the embedded demo without Redis).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from pipeline import metrics
from pipeline.cache.config import MAX_TTL_S
from pipeline.redis_lean import LeanRedis
from topics.cache import Entry

log = logging.getLogger(__name__)
AWAY = (RedisError, OSError)  # away (state.redis_store.DOWN) or refusing: either way the cache misses
_decoder = msgspec.msgpack.Decoder(Entry)


class ExactTier(Protocol):
    async def get(self, key: str) -> Entry | None: ...

    async def put(self, entry: Entry) -> None: ...

    async def purge(self, prefix: str) -> int: ...

    async def aclose(self) -> None: ...


def _stored(entry: Entry) -> bytes:
    """What the exact tier keeps: the entry without its vector (the semantic tier's business)."""
    return msgspec.msgpack.encode(msgspec.structs.replace(entry, vector=b""))


class RedisExactTier:
    def __init__(self, redis: Redis | LeanRedis) -> None:
        self._redis = redis

    async def get(self, key: str) -> Entry | None:
        try:
            raw = await self._redis.get(key)
        except AWAY as exc:
            _away("get", exc)
            return None
        if raw is None:
            return None
        try:
            entry = _decoder.decode(raw)
        except msgspec.DecodeError:
            log.warning("cache: an unreadable exact entry was ignored")
            return None
        return entry if entry.expires_at > time.time() else None

    async def put(self, entry: Entry) -> None:
        """Stores `entry` until it expires; nothing when it has, or when it would outlive MAX_TTL_S (an
        expiry Redis refuses, or infinite, or not a number)."""
        ttl_s = entry.expires_at - time.time()
        if not 0 < ttl_s <= MAX_TTL_S:
            return
        try:
            await self._redis.set(entry.key, _stored(entry), px=max(int(ttl_s * 1000), 1))
        except AWAY as exc:
            _away("put", exc)

    async def purge(self, prefix: str) -> int:
        """Deletes every key under `prefix` (SCAN, then DEL in batches); returns how many."""
        removed, batch = 0, []
        async for key in self._redis.scan_iter(match=prefix + "*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                removed += await self._redis.delete(*batch)
                batch = []
        if batch:
            removed += await self._redis.delete(*batch)
        return removed

    async def aclose(self) -> None:
        await self._redis.aclose()


class MemoryExactTier:
    def __init__(self, max_entries: int = 10_000) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._max = max_entries

    async def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.expires_at > time.time() else None

    async def put(self, entry: Entry) -> None:
        self._entries[entry.key] = _decoder.decode(_stored(entry))
        self._entries.move_to_end(entry.key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def purge(self, prefix: str) -> int:
        doomed = [k for k in self._entries if k.startswith(prefix)]
        for key in doomed:
            del self._entries[key]
        return len(doomed)

    async def aclose(self) -> None:
        pass


def _away(operation: str, exc: BaseException) -> None:
    metrics.CACHE_DEGRADED.labels(operation).inc()
    log.warning("cache: exact tier %s skipped, Redis unavailable or refusing (%s)", operation, type(exc).__name__)

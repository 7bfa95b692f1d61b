"""The exact tier: an answer per exact key (pipeline.cache.keys), in Redis, each with its TTL.

Every key expires (Redis' `volatile-*` eviction may drop any of them first). A cache that cannot reach
Redis answers nothing and stores nothing: a miss costs a generation, never a wrong or a late answer,
so `get` and `put` never raise for Redis being away (they count it in a metric and log a warning).
`MemoryExactTier` is the same for one process (unit tests, the embedded demo without Redis).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Protocol

import msgspec
from redis.asyncio import Redis

from pipeline import metrics
from pipeline.redis_lean import LeanRedis
from pipeline.state.redis_store import DOWN
from topics.cache import Entry

log = logging.getLogger(__name__)
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
        except DOWN as exc:
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
        ttl_ms = int((entry.expires_at - time.time()) * 1000)
        if ttl_ms <= 0:
            return
        try:
            await self._redis.set(entry.key, _stored(entry), px=ttl_ms)
        except DOWN as exc:
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
    log.warning("cache: exact tier %s skipped, Redis unavailable (%s)", operation, type(exc).__name__)

"""The Redis JobStore.

    sluice:batch:{<id>}:job       hash: status, record (the Batch, msgpack)
    sluice:batch:{<id>}:out       hash: line key -> its outcome (Recorded), set once (lua/record.lua)
    sluice:batch:{<id>}:counts    hash: completed, failed (counted by the same script, so exactly once)
    sluice:batch:{<id>}:lease     the worker driving the job, with a TTL (lua/lease.lua)
    sluice:batch:tenant:<tenant>  sorted set of the tenant's job ids by creation time (listing)
    sluice:batch:active:<tenant>  sorted set of the tenant's unfinished job ids by window end (its cap)
    sluice:batch:active           set of unfinished job ids (what workers look for)

Every key expires. A job's keys expire `keep_s` after its completion window closes from the moment they
are made (lua/create.lua; record.lua gives `:out` and `:counts` the job's expiry), and `keep_s` after the
job ends once it does (lua/update.lua). A tenant's list and count expire with their newest entry, and
each create drops the entries of jobs whose keys have expired (list) or whose window closed (count). The
one exception is `active`, shared by all jobs: an id leaves it when its job ends, or when a worker finds
the job's record gone.

Why expire a running job: Redis (infra/redis/redis.conf: `maxmemory`, `volatile-lru`) evicts only keys
with a TTL, so keys without one that fill it make every write fail, for every stage. With one, a running
job's keys are written as its lines finish and so are among the last a least-recently-used eviction takes
(finished jobs and caches go first); what bounds them is the number of unfinished jobs (`max_active` per
tenant at create). Redis keeps an append-only file.

A job's keys share one hash tag, so every script but create.lua touches one Redis Cluster slot; create.lua
also touches its tenant's keys and `active` (one Redis, as the deployment has). Redis being away is
`InfraUnavailable`, which callers wait out.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pipeline.batch.records import TERMINAL, Batch, Counts, Recorded, Status
from pipeline.errors import InfraUnavailable
from pipeline.state.redis_store import DOWN

_LUA = Path(__file__).with_name("lua")
PREFIX = "sluice:batch:"
ACTIVE = PREFIX + "active"


@contextmanager
def _reachable() -> Iterator[None]:
    try:
        yield
    except DOWN as exc:
        raise InfraUnavailable(f"redis batch store: {type(exc).__name__}") from None


class _Script:
    def __init__(self, name: str) -> None:
        self.text = (_LUA / name).read_text()
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()


def _key(batch_id: str, part: str) -> str:
    return f"{PREFIX}{{{batch_id}}}:{part}"


def _tenant_key(tenant: str) -> str:
    return PREFIX + "tenant:" + tenant


def _places_key(tenant: str) -> str:
    return PREFIX + "active:" + tenant


class RedisJobStore:
    """JobStore on Redis; the client must return bytes. It owns the client (`aclose` closes it)."""

    def __init__(self, redis: Redis, *, keep_s: float = 30 * 24 * 3600.0) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisJobStore needs a client that returns bytes (decode_responses=False)")
        self._redis = redis
        self._keep_s = keep_s
        self._keep_ms = max(int(keep_s * 1000), 1)
        self._create = _Script("create.lua")
        self._record = _Script("record.lua")
        self._update = _Script("update.lua")
        self._lease = _Script("lease.lua")
        self._release = _Script("release.lua")
        self._batch = msgspec.msgpack.Decoder(Batch)
        self._outcome = msgspec.msgpack.Decoder(Recorded)

    async def _eval(self, script: _Script, keys: list[str], args: list[Any]) -> Any:
        with _reachable():
            try:
                return await cast(Any, self._redis.evalsha(script.sha, len(keys), *keys, *args))
            except NoScriptError:  # Redis restarted and lost its script cache
                return await cast(Any, self._redis.eval(script.text, len(keys), *keys, *args))

    async def create(self, batch: Batch, *, listed: bool = True, max_active: int = 0) -> bool:
        now = time.time()  # finer than created_at: the list is newest first
        # an older job's keys have expired (unless it ended past its window: then it is found by id, not listed)
        lifetime_s = batch.expires_at - batch.created_at + self._keep_s
        keys = [_key(batch.id, "job"), _tenant_key(batch.tenant), _places_key(batch.tenant), ACTIVE]
        args = [batch.id, batch.status.value, msgspec.msgpack.encode(batch), int((batch.expires_at + self._keep_s) * 1000),
                now, now - lifetime_s, batch.expires_at, 1 if listed else 0, max_active, max(int(lifetime_s * 1000), 1)]
        return bool(await self._eval(self._create, keys, args))

    async def get(self, batch_id: str) -> Batch | None:
        with _reachable():
            raw = await self._redis.hget(_key(batch_id, "job"), "record")
        return None if raw is None else self._batch.decode(raw)

    async def update(self, batch: Batch, expect: Collection[Status]) -> bool:
        ttl = self._keep_ms if batch.status in TERMINAL else 0
        args = [" ".join(s.value for s in expect), batch.status.value, msgspec.msgpack.encode(batch), ttl]
        return bool(await self._eval(self._update, [_key(batch.id, "job"), _key(batch.id, "counts"), _key(batch.id, "out")], args))

    async def list(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        key = _tenant_key(tenant)
        with _reachable():
            start = 0
            if after is not None:
                rank = await self._redis.zrevrank(key, after)
                if rank is None:
                    return [], False
                start = rank + 1
            ids = await self._redis.zrevrange(key, start, start + limit)  # one more than asked: is there more?
        batches = []
        for raw_id in ids[:limit]:
            batch = await self.get(raw_id.decode())
            if batch is None:  # expired: drop it from the index as we pass
                with _reachable():
                    await self._redis.zrem(key, raw_id)
                continue
            batches.append(batch)
        return batches, len(ids) > limit

    async def active(self) -> list[str]:
        with _reachable():
            return sorted(m.decode() for m in await self._redis.smembers(ACTIVE))

    async def deactivate(self, batch_id: str, tenant: str | None = None) -> None:
        with _reachable():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.srem(ACTIVE, batch_id)
                if tenant is not None:
                    pipe.zrem(_places_key(tenant), batch_id)
                await pipe.execute()

    async def lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self._eval(self._lease, [_key(batch_id, "lease")], [owner, max(int(ttl_s * 1000), 1)]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._eval(self._release, [_key(batch_id, "lease")], [owner])

    async def record(self, batch_id: str, key: str, outcome: Recorded) -> bool:
        keys = [_key(batch_id, "out"), _key(batch_id, "counts"), _key(batch_id, "job")]
        counter = "completed" if outcome.ok else "failed"
        return bool(await self._eval(self._record, keys, [key, msgspec.msgpack.encode(outcome), counter]))

    async def recorded_keys(self, batch_id: str) -> set[str]:
        with _reachable():
            return {k.decode() for k in await self._redis.hkeys(_key(batch_id, "out"))}

    async def results(self, batch_id: str) -> list[Recorded]:
        """Every outcome once: HSCAN may return a field twice (when the hash is rehashed between pages),
        and a line written twice to the output file would be a second answer to one request."""
        out: dict[bytes, Recorded] = {}
        with _reachable():
            async for field, value in self._redis.hscan_iter(_key(batch_id, "out"), count=1000):
                out[field] = self._outcome.decode(value)
        return list(out.values())

    async def counts(self, batch_id: str) -> Counts:
        with _reachable():
            raw = await self._redis.hgetall(_key(batch_id, "counts"))
        return Counts(0, int(raw.get(b"completed", 0)), int(raw.get(b"failed", 0)))

    async def forget_results(self, batch_id: str) -> None:
        with _reachable():
            await self._redis.delete(_key(batch_id, "out"))

    async def aclose(self) -> None:
        await self._redis.aclose()


__all__ = ["RedisJobStore"]

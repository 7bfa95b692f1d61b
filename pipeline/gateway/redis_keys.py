"""The Redis KeyStore.

    sluice:key:{<sha256>}    the KeyEntry for one hash (expires with the hash after a rotation)
    sluice:keyrec:{<id>}     the KeyRecord, by public id (for rotate, revoke, list)
    sluice:keyids            the set of ids

Key records are durable state: Redis runs with an append-only file and evicts only keys with a TTL
(infra/redis/redis.conf), so a restart or memory pressure does not lose them.
"""

from __future__ import annotations

import msgspec
from redis.asyncio import Redis

from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.keys import KeyEntry, KeyRecord
from pipeline.gateway.redis_limits import DOWN
from pipeline.redis_lean import LeanRedis

IDS = "sluice:keyids"


def _hash_key(key_hash: str) -> str:
    return "sluice:key:{" + key_hash + "}"


def _record_key(key_id: str) -> str:
    return "sluice:keyrec:{" + key_id + "}"


class RedisKeyStore:
    def __init__(self, redis: Redis | LeanRedis) -> None:
        self._redis = redis
        self._entry = msgspec.json.Decoder(KeyEntry)
        self._record = msgspec.json.Decoder(KeyRecord)

    async def lookup(self, key_hash: str) -> KeyEntry | None:
        try:
            raw = await self._redis.get(_hash_key(key_hash))
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        return self._entry.decode(raw) if raw else None

    async def save(self, record: KeyRecord) -> None:
        slim = msgspec.structs.replace(record, hashes={}, verify_keys={})  # an entry lists only its own hash's
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(_record_key(record.key_id), msgspec.json.encode(record))
                pipe.sadd(IDS, record.key_id)
                for key_hash, not_after in record.hashes.items():
                    own = {key_hash: record.verify_keys[key_hash]} if key_hash in record.verify_keys else {}
                    entry = msgspec.json.encode(KeyEntry(msgspec.structs.replace(slim, verify_keys=own), not_after))
                    if not_after:
                        pipe.set(_hash_key(key_hash), entry, pxat=int(not_after * 1000))
                    else:
                        pipe.set(_hash_key(key_hash), entry)
                await pipe.execute()
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None

    async def forget_hash(self, key_hash: str) -> None:
        try:
            await self._redis.delete(_hash_key(key_hash))
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None

    async def get(self, key_id: str) -> KeyRecord | None:
        try:
            raw = await self._redis.get(_record_key(key_id))
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        return self._record.decode(raw) if raw else None

    async def all(self) -> list[KeyRecord]:
        try:
            ids = sorted(i.decode() for i in await self._redis.smembers(IDS))
            raws = [await self._redis.get(_record_key(i)) for i in ids]
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        return [self._record.decode(r) for r in raws if r]

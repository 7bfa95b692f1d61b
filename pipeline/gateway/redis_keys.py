"""The Redis KeyStore.

    sluice:key:{<sha256>}    the KeyEntry for one hash (expires with the hash after a rotation)
    sluice:keyrec:{<id>}     the KeyRecord, by public id (for rotate, revoke, list)
    sluice:keyids            the set of ids

A rotation or revocation replaces a record with `lua/update_key.lua`, a compare and set on its version,
so one that read the record before another's write cannot write over it.

Key records are durable state: Redis runs with an append-only file and evicts only keys with a TTL
(infra/redis/redis.conf), so a restart or memory pressure does not lose them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pipeline.gateway.errors import KeyChanged, StoreUnavailable
from pipeline.gateway.keys import KeyEntry, KeyRecord
from pipeline.gateway.redis_limits import DOWN
from pipeline.redis_lean import LeanRedis

IDS = "sluice:keyids"
UPDATE = (Path(__file__).with_name("lua") / "update_key.lua").read_text()
UPDATE_SHA = hashlib.sha1(UPDATE.encode()).hexdigest()


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
        await self._write(record, with_record=True)

    async def update(self, record: KeyRecord) -> None:
        """The hash entries first, as `save` writes them (copies, each on its own slot: a lookup accepts
        one only while the record lists its hash, `keys.confirmed`), then the record by compare and set
        (one slot). Refused, it deletes again the entries of hashes the stored record does not list (a
        rotation's new key), and a revocation that wins after the set reads the new hashes and deletes them."""
        await self._write(record, with_record=False)
        args = (_record_key(record.key_id), record.version - 1, msgspec.json.encode(record))
        try:
            try:
                written = await self._redis.evalsha(UPDATE_SHA, 1, *args)
            except NoScriptError:  # Redis restarted since it was loaded
                await self._redis.script_load(UPDATE)
                written = await self._redis.evalsha(UPDATE_SHA, 1, *args)
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        if int(written) != 1:
            stored = await self.get(record.key_id)
            for key_hash in record.hashes.keys() - (stored.hashes.keys() if stored else set()):
                await self.forget_hash(key_hash)
            raise KeyChanged(f"key {record.key_id!r} was changed meanwhile")

    async def _write(self, record: KeyRecord, *, with_record: bool) -> None:
        slim = msgspec.structs.replace(record, hashes={}, verify_keys={})  # an entry lists only its own hash's
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if with_record:
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

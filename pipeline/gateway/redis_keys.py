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
UNDO_TRIES = 3  # a refused update puts its entries back from the stored record, read again this often if it moves


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
        one only while the record lists its hash, and only until the record's expiry for it,
        `keys.confirmed`), then the record by compare and set (one slot). Refused, it puts back what it
        wrote from the stored record (`_undo`), and a revocation that wins after the set reads the new
        hashes and deletes them."""
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
            await self._undo(record)
            raise KeyChanged(f"key {record.key_id!r} was changed meanwhile")

    async def _undo(self, refused: KeyRecord) -> None:
        """The entries a refused `update` wrote, as the stored record has them: gone where it does not list
        the hash (a rotation's new key), rewritten from it where it does. Else a rotation that lost to
        `rotate --overlap-s 0` left the old key's entry, and its Redis expiry, a day ahead. Read again
        after, in case another update landed meanwhile; one that lands later still can leave an entry
        its record outlives or cuts short, which `confirmed` reads past."""
        for _ in range(UNDO_TRIES):
            stored = await self.get(refused.key_id)
            listed = stored.hashes if stored is not None else {}
            for key_hash in refused.hashes.keys() - listed.keys():
                await self.forget_hash(key_hash)
            kept = {h: t for h, t in listed.items() if h in refused.hashes}
            if stored is not None and kept:
                await self._write(msgspec.structs.replace(stored, hashes=kept), with_record=False)
            if await self.get(refused.key_id) == stored:
                return

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

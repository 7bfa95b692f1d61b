"""The Redis StateStore: one hash per key, `prefix + "{key}"`, so each key has its own hash tag and one
Redis Cluster slot. Every operation is one round trip: `lua/write_owned.lua`, `lua/advance.lua`, `lua/claim.lua`
and `lua/take.lua` for the ones that read before they write, HSET + PEXPIRE in one MULTI for a plain write.
Every key has a TTL, and after any write at least half of it is left: the scripts refresh it only when
less is, since a PEXPIRE on each of a request's seven script calls was a sixth of what Redis appended
to its AOF per request, and the rewrites of that file on the same cores are the worst of the pipeline's
latency tails (docs/benchmarks.md, "Session 35"). Scripts are called by EVALSHA and loaded again when
Redis lost them (a restart)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import InfraUnavailable
from pipeline.redis_lean import LeanRedis

_LUA = Path(__file__).with_name("lua")
# Redis is away. BusyLoadingError (a restart loading its data) is a ConnectionError; named for the reader.
DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)


@contextmanager
def _reachable() -> Iterator[None]:
    """Turns Redis being away into InfraUnavailable, naming only the error's class (never the URL)."""
    try:
        yield
    except DOWN as exc:
        raise InfraUnavailable(f"redis state store: {type(exc).__name__}") from None


class _Script:
    """A Lua file, called by its SHA1; `RedisStateStore._eval` loads the text when Redis does not know it."""

    def __init__(self, name: str) -> None:
        self.text = (_LUA / name).read_text()
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()


class RedisStateStore:
    """StateStore on Redis, through `LeanRedis` (what the stages use) or redis-py's client, which must
    return bytes (not `decode_responses=True`); the store owns it and `aclose` closes it. Raises `InfraUnavailable` (naming only the error's class, never the URL) when
    Redis cannot be reached or times out."""

    def __init__(self, redis: Redis | LeanRedis, *, ttl_s: float = 3600.0, prefix: str = "sluice:state:") -> None:
        if ttl_s <= 0:
            raise ValueError(f"RedisStateStore needs ttl_s > 0, got {ttl_s}")
        if isinstance(redis, Redis) and redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisStateStore needs a client that returns bytes (decode_responses=False)")
        self._redis = redis
        self._ttl_ms = max(int(ttl_s * 1000), 1)
        self._prefix = prefix
        self._write_owned = _Script("write_owned.lua")
        self._advance = _Script("advance.lua")
        self._claim = _Script("claim.lua")
        self._amend = _Script("amend.lua")
        self._take = _Script("take.lua")

    def _key(self, key: str) -> str:
        return self._prefix + "{" + key + "}"

    async def _eval(self, script: _Script, key: str, *args: str | bytes | int) -> Any:
        """EVALSHA `script` on `key` with the TTL as ARGV[1]; loads the script once if Redis lost it."""
        keys_and_args = (self._key(key), self._ttl_ms, *args)
        with _reachable():
            try:
                return await self._redis.evalsha(script.sha, 1, *keys_and_args)
            except NoScriptError:
                await self._redis.script_load(script.text)
                return await self._redis.evalsha(script.sha, 1, *keys_and_args)

    async def read(self, key: str) -> dict[str, bytes]:
        with _reachable():
            raw = cast(dict[bytes, bytes], await self._redis.hgetall(self._key(key)))  # bytes: see __init__
        return {name.decode(): value for name, value in raw.items()}

    async def write(self, key: str, fields: Mapping[str, bytes], *, owner: str | None = None) -> bool:
        pairs = [item for name, value in fields.items() for item in (name, value)]
        if owner is not None:
            return int(await self._eval(self._write_owned, key, owner, *pairs)) == 1
        with _reachable():
            async with self._redis.pipeline(transaction=True) as pipe:  # MULTI: one round trip, all or nothing
                if pairs:
                    pipe.hset(self._key(key), items=pairs)
                pipe.pexpire(self._key(key), self._ttl_ms)
                await pipe.execute()
        return True

    async def advance(
        self, key: str, field: str, position: int, fields: Mapping[str, bytes], *, owner: str,
        always: Mapping[str, bytes] | None = None,
    ) -> bool:
        first = [item for name, value in (always or {}).items() for item in (name, value)]
        pairs = [item for name, value in fields.items() for item in (name, value)]
        return int(await self._eval(self._advance, key, owner, field, position, len(first) // 2, *first, *pairs)) == 1

    async def amend(self, key: str, fields: Mapping[str, bytes]) -> bool:
        pairs = [item for name, value in fields.items() for item in (name, value)]
        return int(await self._eval(self._amend, key, *pairs)) == 1

    async def claim(self, key: str, field: str, value: bytes) -> bool:
        return int(await self._eval(self._claim, key, field, value)) == 1

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        flat: list[bytes] = await self._eval(self._take, key, owner)
        return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}

    async def forget(self, key: str) -> None:
        with _reachable():
            await self._redis.delete(self._key(key))

    async def aclose(self) -> None:
        await self._redis.aclose()

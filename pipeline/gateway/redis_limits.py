"""The Redis Limiter: `lua/admit.lua`, `lua/charge.lua` and `lua/release.lua`, one atomic script per
scope, on Redis's clock, each sent with `lua/window.lua` (the clock, the token log and its total, TTLs) in
front of it. A scope's keys share the hash tag `{kind:name}`, so on Redis Cluster each script touches
one slot; the scopes of one request are sent in one pipeline (one round trip), with `lua/ticket.lua`
(the ticket, under the member's own tag, written only if none is kept).

A request id is one request: admit.lua says whether it added the member to a scope or found it there
(a redelivery, or another request under an id in use, which ingest refuses). Only the call that added the
member to the first scope keeps its ticket; a call that found it leaves the ticket and the window entries
where they are, and a refused call undoes only what it added itself. Else a second request under a
running request's id, refused, replaced or deleted that request's ticket (charged nothing) and took it
out of the windows."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.limits import Refusal, Resource, Scope
from pipeline.redis_lean import LeanPipeline, LeanRedis

_LUA = Path(__file__).with_name("lua")
DOWN = (RedisConnectionError, RedisTimeoutError, OSError)  # BusyLoadingError (a restart) is a ConnectionError
Pipe = Pipeline | LeanPipeline  # either client's pipeline: the same calls
REFUSED, ADDED = 0, 1  # admit.lua's first reply (2: admitted, the member was recorded already)


def rate_keys(scope: Scope) -> list[str]:
    tag = "{" + scope.tag + "}"
    return [f"sluice:rl:{tag}:req", f"sluice:rl:{tag}:tok", f"sluice:rl:{tag}:toksum"]


def spend_key(scope: Scope) -> str:
    return "sluice:spend:{" + scope.tag + "}"


def ticket_key(member: str) -> str:
    return "sluice:ticket:{" + member + "}"


class _Script:
    """A Lua file called by EVALSHA, after `lua/window.lua` (what the scripts share: Redis has no include);
    `RedisLimiter._run` loads it again after Redis lost it (a restart)."""

    def __init__(self, name: str, shared: bool = True) -> None:
        self.text = ((_LUA / "window.lua").read_text() if shared else "") + (_LUA / name).read_text()
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

    def __call__(self, pipe: Pipe, keys: list[str], args: list[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)


class RedisLimiter:
    def __init__(self, redis: Redis | LeanRedis, window_s: float) -> None:
        self._redis = redis
        self._window_ms = int(window_s * 1000)
        self._admit = _Script("admit.lua")
        self._charge = _Script("charge.lua")
        self._release = _Script("release.lua")
        self._ticket = _Script("ticket.lua", shared=False)

    async def _run(self, build: Callable[[Pipe], None]) -> list[Any]:
        """One round trip of the commands `build` queues; StoreUnavailable if Redis is away."""
        try:
            for attempt in (1, 2):
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        build(pipe)
                        return list(await pipe.execute())
                except NoScriptError:
                    if attempt == 2:
                        raise
                    for script in (self._admit, self._charge, self._release, self._ticket):
                        await self._redis.script_load(script.text)
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        raise AssertionError("unreachable")

    async def admit(self, scopes: Sequence[Scope], member: str, tokens: int, ticket: bytes, ticket_ttl_s: float) -> Refusal | None:
        def admit_all(pipe: Pipe) -> None:
            for s in scopes:
                args = [self._window_ms, s.rpm, s.tpm, repr(float(s.budget)), member, tokens]
                self._admit(pipe, [*rate_keys(s), spend_key(s)], args)
            self._ticket(pipe, [ticket_key(member)], [ticket, max(int(ticket_ttl_s * 1000), 1000)])

        *results, wrote = await self._run(admit_all)
        added = [int(r[0]) == ADDED for r in results]
        refused = [(s, r) for s, r in zip(scopes, results, strict=True) if int(r[0]) == REFUSED]
        ours = not refused and (added[0] if added else True)  # this call's request: it keeps the ticket it wrote

        def undo(pipe: Pipe) -> None:
            for s, new in zip(scopes, added, strict=True):
                if refused and new:
                    self._release(pipe, rate_keys(s), [self._window_ms, member, tokens])
            if int(wrote) and not ours:  # none was kept: the running request's (if any) was taken already
                pipe.delete(ticket_key(member))

        if (refused and any(added)) or (int(wrote) and not ours):
            await self._run(undo)
        if not refused:
            return None
        scope, (_, resource, limit, remaining, retry_ms) = refused[0]
        res: Resource = resource.decode() if isinstance(resource, bytes) else resource
        limit_value = scope.budget if res == "budget" else int(limit)
        retry = None if int(retry_ms) < 0 else max(int(retry_ms), 1) / 1000.0
        return Refusal(scope, res, limit_value, int(remaining), retry)

    async def charge(self, scopes: Sequence[Scope], member: str, reserved: int, tokens: int, spend: float) -> None:
        def charge_all(pipe: Pipe) -> None:
            for s in scopes:
                keys = [rate_keys(s)[1], rate_keys(s)[2], spend_key(s)]
                args = [self._window_ms, member, reserved, max(tokens, 0), repr(float(spend if s.billed else 0.0))]
                self._charge(pipe, keys, args)

        await self._run(charge_all)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def take_ticket(self, member: str) -> bytes | None:
        try:
            value: bytes | None = await self._redis.getdel(ticket_key(member))
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        return value

    async def spent(self, scope: Scope) -> float:
        try:
            value = await self._redis.get(spend_key(scope))
        except DOWN as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from None
        return float(value or 0.0)

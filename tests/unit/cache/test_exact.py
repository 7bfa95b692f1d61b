"""The exact tier answers a miss and stores nothing whenever Redis does not do what it is asked: away, or
refusing with an error reply (READONLY after a failover, OOM, NOPERM, an expiry it will not take). A
refusal that escaped `put` reached the client as a second terminal event after its answer (emit stores
after the `Done`; docs/reliability.md, session 47)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from pipeline.cache import keys
from pipeline.cache.config import MAX_TTL_S
from pipeline.cache.exact import RedisExactTier
from topics.cache import Entry

pytestmark = pytest.mark.asyncio


class Refusing:
    """A Redis client whose every command raises `error`; `sets`: the SETs that reached it."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.sets: list[tuple[str, int]] = []

    async def get(self, key: str) -> bytes | None:
        if self.error is not None:
            raise self.error
        return None

    async def set(self, key: str, value: bytes, px: int) -> Any:
        if self.error is not None:
            raise self.error
        self.sets.append((key, px))
        return True


def entry(ttl_s: float = 60.0) -> Entry:
    now = time.time()
    return Entry(key=keys.scope("t", "m") + "k", tenant="t", model="m", context="c", chunks=("a",),
                 finish_reason="stop", prompt_tokens=1, completion_tokens=1, stored_at=now, expires_at=now + ttl_s)


@pytest.mark.parametrize("error", [
    ResponseError("invalid expire time in 'set' command"),
    ReadOnlyError("You can't write against a read only replica."),
    ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
    RedisConnectionError("Connection closed."),
])
async def test_an_error_reply_is_a_miss_and_nothing_stored_never_an_exception(error: Exception) -> None:
    exact = RedisExactTier(Refusing(error))  # type: ignore[arg-type]
    assert await exact.get(entry().key) is None
    await exact.put(entry())


@pytest.mark.parametrize("ttl_s", [float("inf"), float("nan"), MAX_TTL_S + 60.0, -1.0])
async def test_an_expiry_redis_would_refuse_or_that_has_passed_is_not_sent(ttl_s: float) -> None:
    redis = Refusing(None)
    await RedisExactTier(redis).put(entry(ttl_s))  # type: ignore[arg-type]
    assert redis.sets == []
    await RedisExactTier(redis).put(entry(60.0))  # type: ignore[arg-type]
    assert len(redis.sets) == 1 and 59_000 < redis.sets[0][1] <= 60_000

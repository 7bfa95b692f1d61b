"""One suite for every implementation of per-request state: the in-memory store (what unit tests use) and
the Redis one on each client (LeanRedis, what the stages use; redis-py's), so all keep the same
semantics. Then what only Redis can show: a TTL on every key, scripts reloaded after Redis lost them,
and InfraUnavailable when Redis is away."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from pipeline.errors import InfraUnavailable
from pipeline.redis_lean import LeanRedis
from pipeline.settings import Settings
from pipeline.state import MemoryStateStore, RedisStateStore, StateStore

pytestmark = pytest.mark.asyncio(loop_scope="session")
TTL_S = 0.5
PREFIX = "sluice:test-state:"


def client(url: str) -> Redis:
    return Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def lean(url: str) -> LeanRedis:
    return LeanRedis.from_url(url, timeout_s=2)


CLIENTS = pytest.mark.parametrize("make", [lean, client], ids=["lean", "redis-py"])
Make = Callable[[str], Redis | LeanRedis]


@pytest_asyncio.fixture(params=["memory", "redis", "lean"], loop_scope="session")
async def store(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[StateStore]:
    backing: StateStore = (
        MemoryStateStore(TTL_S) if request.param == "memory"
        else RedisStateStore((client if request.param == "redis" else lean)(settings.redis.url), ttl_s=TTL_S, prefix=PREFIX)
    )
    yield backing
    await backing.aclose()


@pytest_asyncio.fixture(loop_scope="session")
async def redis(settings: Settings) -> AsyncIterator[Redis]:
    """A second client, to look at what the Redis store wrote."""
    redis = client(settings.redis.url)
    yield redis
    await redis.aclose()


def key() -> str:
    return "req-" + uuid.uuid4().hex


async def test_a_missing_key_reads_empty(store: StateStore) -> None:
    assert await store.read(key()) == {}


async def test_write_then_read_round_trip(store: StateStore) -> None:
    k = key()
    assert await store.write(k, {"stage": b"decode", "tokens": b"12"}) is True
    assert await store.write(k, {"tokens": b"13", "raw": bytes(range(256))}) is True  # merges, overwrites
    assert await store.read(k) == {"stage": b"decode", "tokens": b"13", "raw": bytes(range(256))}


async def test_a_write_refreshes_the_ttl_and_keys_expire(store: StateStore) -> None:
    k = key()
    await store.write(k, {"a": b"1"})
    await asyncio.sleep(TTL_S * 0.6)
    await store.write(k, {"b": b"2"})
    await asyncio.sleep(TTL_S * 0.6)  # past the first write's TTL, within the second's
    assert await store.read(k) == {"a": b"1", "b": b"2"}
    await asyncio.sleep(TTL_S * 0.6)
    assert await store.read(k) == {}
    assert await store.write(k, {"c": b"3"}, owner="w1") is False  # an expired key has no owner


async def test_claim_succeeds_once(store: StateStore) -> None:
    k = key()
    assert await store.claim(k, "emitted", b"w1") is True
    assert await store.claim(k, "emitted", b"w2") is False
    assert await store.claim(k, "charged", b"w2") is True
    assert await store.read(k) == {"emitted": b"w1", "charged": b"w2"}


async def test_amend_writes_only_a_key_that_exists(store: StateStore) -> None:
    k = key()
    assert await store.amend(k, {"cancel": b"client_gone"}) is False
    assert await store.read(k) == {}  # nothing left behind for a key nobody made
    await store.claim(k, "fingerprint", b"f")
    assert await store.amend(k, {"cancel": b"client_gone"}) is True
    assert await store.read(k) == {"fingerprint": b"f", "cancel": b"client_gone"}


async def test_take_returns_the_fields_before_and_sets_the_owner(store: StateStore) -> None:
    k = key()
    assert await store.take(k, "w1") == {}
    await store.write(k, {"offset": b"7"})
    assert await store.take(k, "w2") == {"owner": b"w1", "offset": b"7"}
    assert await store.read(k) == {"owner": b"w2", "offset": b"7"}


async def test_writes_are_fenced_by_owner(store: StateStore) -> None:
    k = key()
    await store.take(k, "w1")
    assert await store.write(k, {"offset": b"1"}, owner="w1") is True
    await store.take(k, "w2")
    assert await store.write(k, {"offset": b"2"}, owner="w1") is False  # w1 lost the request to w2
    assert await store.read(k) == {"owner": b"w2", "offset": b"1"}
    assert await store.write(k, {"offset": b"3"}, owner="w2") is True
    assert await store.read(k) == {"owner": b"w2", "offset": b"3"}
    missing = key()
    assert await store.write(missing, {"offset": b"1"}, owner="w1") is False
    assert await store.read(missing) == {}


async def test_a_position_only_moves_forward_and_is_fenced_by_owner(store: StateStore) -> None:
    k = key()
    await store.take(k, "w1")
    assert await store.advance(k, "emitted", 3, {"digest": b"c"}, owner="w1") is True
    assert await store.advance(k, "emitted", 2, {"digest": b"b"}, owner="w1") is True  # late: nothing written
    assert await store.read(k) == {"owner": b"w1", "emitted": b"3", "digest": b"c"}
    assert await store.advance(k, "emitted", 10, {}, owner="w1") is True  # compared as numbers, not bytes
    assert (await store.read(k))["emitted"] == b"10"
    await store.take(k, "w2")
    assert await store.advance(k, "emitted", 11, {"digest": b"x"}, owner="w1") is False
    assert await store.read(k) == {"owner": b"w2", "emitted": b"10", "digest": b"c"}
    assert await store.advance(key(), "emitted", 1, {}, owner="w1") is False  # a missing key has no owner


async def test_an_ending_is_recorded_with_the_last_position_or_after_it(store: StateStore) -> None:
    """`always`: a request's ending goes with its last position in one call, and is written even when
    that position was recorded already (a late write); still fenced by the owner."""
    k = key()
    await store.take(k, "w1")
    assert await store.advance(k, "emitted", 2, {"digest": b"b"}, owner="w1", always={"terminal": b"1"}) is True
    assert await store.read(k) == {"owner": b"w1", "emitted": b"2", "digest": b"b", "terminal": b"1"}
    other = key()
    await store.take(other, "w1")
    assert await store.advance(other, "emitted", 2, {"digest": b"b"}, owner="w1") is True
    assert await store.advance(other, "emitted", 2, {"digest": b"late"}, owner="w1", always={"terminal": b"1"}) is True
    assert await store.read(other) == {"owner": b"w1", "emitted": b"2", "digest": b"b", "terminal": b"1"}
    await store.take(other, "w2")
    assert await store.advance(other, "emitted", 3, {}, owner="w1", always={"finished": b"x"}) is False
    assert "finished" not in await store.read(other)


async def test_forget_deletes_the_key(store: StateStore) -> None:
    k = key()
    await store.take(k, "w1")
    await store.forget(k)
    assert await store.read(k) == {}
    assert await store.write(k, {"a": b"1"}, owner="w1") is False
    await store.forget(k)  # forgetting a missing key is not an error


async def test_concurrent_takes_see_each_other_exactly_once(store: StateStore) -> None:
    for _ in range(20):
        k = key()
        first, second = await asyncio.gather(store.take(k, "a"), store.take(k, "b"))
        saw_other = [first.get("owner") == b"b", second.get("owner") == b"a"]
        assert sorted(saw_other) == [False, True]
        winner = b"b" if saw_other[1] else b"a"  # whoever took second owns the key
        assert (await store.read(k))["owner"] == winner


@CLIENTS
async def test_every_key_the_redis_store_writes_has_a_ttl(settings: Settings, redis: Redis, make: Make) -> None:
    store = RedisStateStore(make(settings.redis.url), ttl_s=30.0, prefix=PREFIX)
    written, claimed, taken, fenced = key(), key(), key(), key()
    await store.write(written, {"a": b"1"})
    await store.claim(claimed, "emitted", b"1")
    await store.take(taken, "w1")
    await store.take(fenced, "w1")
    await redis.persist(PREFIX + "{" + fenced + "}")
    assert await store.write(fenced, {"a": b"1"}, owner="w1") is True
    for k in (written, claimed, taken, fenced):
        assert 0 < await redis.pttl(PREFIX + "{" + k + "}") <= 30_000, k
    await store.aclose()


@CLIENTS
async def test_a_script_call_refreshes_the_ttl_only_when_less_than_half_is_left(settings: Settings, redis: Redis, make: Make) -> None:
    """A PEXPIRE on every call was a sixth of what Redis appended to its AOF per request."""
    store = RedisStateStore(make(settings.redis.url), ttl_s=30.0, prefix=PREFIX)
    k = key()
    name = PREFIX + "{" + k + "}"
    calls = [
        lambda: store.take(k, "w1"), lambda: store.claim(k, f"c{key()}", b"1"),
        lambda: store.write(k, {"a": b"1"}, owner="w1"), lambda: store.advance(k, "seq", 1, {}, owner="w1"),
    ]
    try:
        await store.take(k, "w1")
        assert await redis.pttl(name) > 29_000  # a new key gets all of it
        for call in calls:
            await redis.pexpire(name, 20_000)  # more than half left: the call leaves it
            await call()
            assert 19_000 < await redis.pttl(name) <= 20_000
            await redis.pexpire(name, 10_000)  # less than half left: the call sets all of it again
            await call()
            assert await redis.pttl(name) > 29_000
    finally:
        await store.aclose()


@CLIENTS
async def test_scripts_are_loaded_again_after_redis_lost_them(settings: Settings, redis: Redis, make: Make) -> None:
    store = RedisStateStore(make(settings.redis.url), ttl_s=30.0, prefix=PREFIX)
    k = key()
    await redis.script_flush()
    assert await store.take(k, "w1") == {}
    await redis.script_flush()
    assert await store.claim(k, "emitted", b"1") is True
    await redis.script_flush()
    assert await store.write(k, {"a": b"1"}, owner="w1") is True
    await store.aclose()


@CLIENTS
async def test_unreachable_redis_raises_infra_unavailable_quickly(make: Make) -> None:
    store = RedisStateStore(make("redis://:hunter2@127.0.0.1:1/0"))
    k = key()
    calls = [
        store.read(k), store.write(k, {"a": b"1"}), store.write(k, {"a": b"1"}, owner="w1"),
        store.claim(k, "f", b"1"), store.take(k, "w1"), store.forget(k),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(InfraUnavailable) as caught:
            await call
        assert time.monotonic() - started < 3.0
        assert "hunter2" not in str(caught.value) and "127.0.0.1" not in str(caught.value)
    await store.aclose()

"""One suite for every implementation of the gateway's shared state: the in-memory limiter and key store
(what unit tests use) and the Redis ones on each client (LeanRedis, what the stages use; redis-py's), so
all keep the same semantics."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from pipeline.gateway.build import redis_client, stage_redis
from pipeline.gateway.keys import KeyEntry, KeyManager, KeyRecord, KeyStore, MemoryKeyStore, hash_key
from pipeline.gateway.limits import Limiter, MemoryLimiter, Scope
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.gateway.redis_limits import RedisLimiter, rate_keys
from pipeline.settings import Settings
from tests.integration.gateway_fixtures import with_gateway

pytestmark = pytest.mark.asyncio(loop_scope="session")
WINDOW_S = 1.0


@pytest_asyncio.fixture(params=["memory", "redis", "lean"], loop_scope="session")
async def limiter(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[Limiter]:
    if request.param == "memory":
        yield MemoryLimiter(WINDOW_S)
        return
    redis = (redis_client if request.param == "redis" else stage_redis)(with_gateway(settings, redis_timeout_s=2.0))
    yield RedisLimiter(redis, WINDOW_S)
    await redis.aclose()


@pytest_asyncio.fixture(params=["memory", "redis", "lean"], loop_scope="session")
async def key_store(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[KeyStore]:
    if request.param == "memory":
        yield MemoryKeyStore()
        return
    redis = (redis_client if request.param == "redis" else stage_redis)(with_gateway(settings, redis_timeout_s=2.0))
    yield RedisKeyStore(redis)
    await redis.aclose()


def scope(kind: str = "key", **limits: float) -> Scope:
    return Scope(kind, "t-" + uuid.uuid4().hex[:10], billed=kind in ("key", "tenant"), **limits)  # type: ignore[arg-type]


def rid() -> str:
    return uuid.uuid4().hex


async def test_requests_up_to_the_limit_then_a_refusal_with_retry_after(limiter: Limiter) -> None:
    s = scope(rpm=3)
    ids = [rid() for _ in range(3)]
    for i in ids:
        assert await limiter.admit([s], i, 0, b"t", 10) is None
    refusal = await limiter.admit([s], rid(), 0, b"t", 10)
    assert refusal is not None and refusal.resource == "requests" and refusal.limit == 3 and refusal.remaining == 0
    assert refusal.retry_after_s is not None and 0 < refusal.retry_after_s <= WINDOW_S
    assert await limiter.admit([s], ids[0], 0, b"t", 10) is None  # a redelivery is not counted again
    await asyncio.sleep(WINDOW_S + 0.05)
    assert await limiter.admit([s], rid(), 0, b"t", 10) is None  # the window slid


async def test_admission_is_all_or_nothing_across_scopes(limiter: Limiter) -> None:
    roomy, full = scope(rpm=10), scope("tenant", rpm=1)
    assert await limiter.admit([full], rid(), 0, b"t", 10) is None
    member = rid()
    refusal = await limiter.admit([roomy, full], member, 5, b"t", 10)
    assert refusal is not None and refusal.scope == full
    assert await limiter.take_ticket(member) is None
    for _ in range(10):  # the refused request left no trace in `roomy`
        assert await limiter.admit([roomy], rid(), 0, b"t", 10) is None
    assert await limiter.admit([roomy], rid(), 0, b"t", 10) is not None


async def test_tokens_admission_and_charge(limiter: Limiter) -> None:
    s = scope(tpm=100)
    first = rid()
    assert await limiter.admit([s], first, 30, b"ticket", 10) is None
    assert await limiter.take_ticket(first) == b"ticket" and await limiter.take_ticket(first) is None
    await limiter.charge([s], first, 60, 0.0)
    await limiter.charge([s], first, 60, 0.0)  # once per request
    assert await limiter.admit([s], rid(), 10, b"t", 10) is None  # 30 + 60 + 10 = 100
    refusal = await limiter.admit([s], rid(), 1, b"t", 10)
    assert refusal is not None and refusal.resource == "tokens" and refusal.remaining == 0
    assert refusal.retry_after_s is not None and refusal.retry_after_s <= WINDOW_S
    never = await limiter.admit([s], rid(), 101, b"t", 10)
    assert never is not None and never.retry_after_s is None


async def test_spend_goes_to_billed_scopes_and_budgets_refuse(limiter: Limiter) -> None:
    key, address = scope(budget=1.0), scope("ip")
    member = rid()
    assert await limiter.admit([key, address], member, 1, b"t", 10) is None
    await limiter.charge([key, address], member, 5, 1.25)
    assert await limiter.spent(key) == pytest.approx(1.25) and await limiter.spent(address) == 0.0
    refusal = await limiter.admit([key, address], rid(), 1, b"t", 10)
    assert refusal is not None and refusal.resource == "budget" and refusal.retry_after_s is None


async def test_key_store_round_trip_expiry_and_forgetting(key_store: KeyStore) -> None:
    manager = KeyManager(key_store, rotate_overlap_s=1.0)
    raw, record = await manager.create("tenant-" + uuid.uuid4().hex[:6], models=("m",), rpm=7, budget=2.0)
    entry = await key_store.lookup(hash_key(raw))
    assert isinstance(entry, KeyEntry) and entry.record.key_id == record.key_id and entry.record.rpm == 7
    assert entry.not_after == 0 and entry.valid(time.time())
    new, _ = await manager.rotate(record.key_id)
    old_entry = await key_store.lookup(hash_key(raw))
    assert old_entry is not None and old_entry.not_after > time.time()
    await asyncio.sleep(1.1)
    gone = await key_store.lookup(hash_key(raw))
    assert gone is None or not gone.valid(time.time())
    assert (await key_store.lookup(hash_key(new))) is not None
    got = await key_store.get(record.key_id)
    assert isinstance(got, KeyRecord) and got.key_id in {r.key_id for r in await key_store.all()}
    await manager.revoke(record.key_id)
    assert await key_store.lookup(hash_key(new)) is None
    assert await key_store.lookup(hash_key("sk-sluice-unknown")) is None


async def test_a_revoke_that_raced_a_rotation_leaves_no_key_that_works(key_store: KeyStore) -> None:
    """The revoke read the record before the rotation saved it: the rotation's new hash entry stayed,
    saying "not revoked", with no expiry, while the record (and `sluice keys list`) said revoked."""
    import msgspec

    from pipeline.gateway.config import GatewaySettings
    from pipeline.gateway.gateway import Gateway
    from tests.unit.helpers import request

    manager = KeyManager(key_store, rotate_overlap_s=60.0)
    raw, record = await manager.create("tenant-" + uuid.uuid4().hex[:6])
    read_by_revoke = await key_store.get(record.key_id)
    new, _ = await manager.rotate(record.key_id)  # saved between the revoke's read and its write
    assert read_by_revoke is not None
    await key_store.save(msgspec.structs.replace(read_by_revoke, revoked=True, hashes={}, verify_keys={}))
    for key_hash in read_by_revoke.hashes:
        await key_store.forget_hash(key_hash)
    gateway = Gateway(GatewaySettings(auth_required=True, key_cache_s=0.0), key_store, MemoryLimiter(WINDOW_S))
    with pytest.raises(Exception) as refused:
        await gateway.admit(request("raced", api_key=new))
    assert getattr(refused.value, "code", None) is not None and refused.value.code.value == "unauthorized"


@pytest.mark.parametrize("client", ["redis", "lean"])
async def test_rate_limit_keys_keep_a_window_of_ttl_set_about_once_a_second(settings: Settings, client: str) -> None:
    """PEXPIREs of the rate-limit keys on every admission and charge were a twelfth of what Redis appended to its
    AOF per request."""
    gateway = with_gateway(settings, redis_timeout_s=2.0)
    redis, check = (redis_client if client == "redis" else stage_redis)(gateway), redis_client(gateway)
    limiter, s = RedisLimiter(redis, WINDOW_S), scope(rpm=100, tpm=1000)
    try:
        assert await limiter.admit([s], rid(), 5, b"t", 10) is None
        names = rate_keys(s)
        ttls = [await check.pttl(name) for name in names]
        assert all(1000 < ttl <= 2000 for ttl in ttls), ttls  # the window and a second
        for name in names:
            await check.pexpire(name, 1500)  # at least the window left: admission leaves it
        assert await limiter.admit([s], rid(), 5, b"t", 10) is None
        assert all([1000 < await check.pttl(name) <= 1500 for name in names])
        for name in names:
            await check.pexpire(name, 500)  # less than the window left: set again
        assert await limiter.admit([s], rid(), 5, b"t", 10) is None
        assert all([await check.pttl(name) > 1500 for name in names])
    finally:
        await redis.aclose()
        await check.aclose()

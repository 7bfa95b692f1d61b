"""One suite for every implementation of the gateway's shared state: the in-memory limiter and key store
(what unit tests use) and the Redis ones on each client (LeanRedis, what the stages use; redis-py's), so
all keep the same semantics."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from pipeline.errors import StageError
from pipeline.gateway import gateway as gateway_module
from pipeline.gateway.build import redis_client, stage_redis
from pipeline.gateway.config import GatewaySettings, ModelPrice
from pipeline.gateway.errors import KeyChanged
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.keys import KeyEntry, KeyManager, KeyRecord, KeyStore, MemoryKeyStore, hash_key
from pipeline.gateway.limits import Limiter, MemoryLimiter, Scope
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.gateway.redis_limits import RedisLimiter, rate_keys
from pipeline.settings import Settings
from tests.integration.gateway_fixtures import with_gateway
from tests.unit.helpers import MODEL, request
from topics.errors import ErrorCode
from topics.requests import ChatMessage, Sampling
from topics.stream import Done, FinishReason, Usage

pytestmark = pytest.mark.asyncio(loop_scope="session")
WINDOW_S = 1.0


@pytest_asyncio.fixture(params=["memory", "redis", "lean"], loop_scope="session")
async def make_limiter(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[Callable[[float], Limiter]]:
    """A limiter of each implementation, with the window a test asks for."""
    if request.param == "memory":
        yield MemoryLimiter
        return
    redis = (redis_client if request.param == "redis" else stage_redis)(with_gateway(settings, redis_timeout_s=2.0))
    yield lambda window_s: RedisLimiter(redis, window_s)
    await redis.aclose()


@pytest_asyncio.fixture(loop_scope="session")
async def limiter(make_limiter: Callable[[float], Limiter]) -> Limiter:
    return make_limiter(WINDOW_S)


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
    await limiter.charge([s], first, 30, 90, 0.0)  # the reservation of 30 replaced by the 90 it used
    await limiter.charge([s], first, 30, 90, 0.0)  # once per request
    assert await limiter.admit([s], rid(), 10, b"t", 10) is None  # 90 + 10 = 100
    refusal = await limiter.admit([s], rid(), 1, b"t", 10)
    assert refusal is not None and refusal.resource == "tokens" and refusal.remaining == 0
    assert refusal.retry_after_s is not None and refusal.retry_after_s <= WINDOW_S
    never = await limiter.admit([s], rid(), 101, b"t", 10)
    assert never is not None and never.retry_after_s is None


async def test_a_request_longer_than_the_window_is_charged_its_spend_once_and_no_more_tokens(limiter: Limiter) -> None:
    s, member = scope(tpm=100, budget=10.0), rid()
    assert await limiter.admit([s], member, 60, b"t", 10) is None
    await asyncio.sleep(WINDOW_S + 0.05)  # its reservation counted for a whole window, and left it
    await limiter.charge([s], member, 60, 60, 1.5)
    await limiter.charge([s], member, 60, 60, 1.5)  # once per request
    assert await limiter.spent(s) == pytest.approx(1.5)
    assert await limiter.admit([s], rid(), 100, b"t", 10) is None


async def test_spend_goes_to_billed_scopes_and_budgets_refuse(limiter: Limiter) -> None:
    key, address = scope(budget=1.0), scope("ip")
    member = rid()
    assert await limiter.admit([key, address], member, 1, b"t", 10) is None
    await limiter.charge([key, address], member, 1, 5, 1.25)
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


class StaleRead(KeyManager):
    """A manager whose rotation read `record` before another rotation saved over it."""

    def __init__(self, store: KeyStore, record: KeyRecord) -> None:
        super().__init__(store, rotate_overlap_s=86400.0)
        self._read = record

    async def _live(self, key_id: str) -> KeyRecord:
        return self._read


async def test_a_rotation_that_lost_to_a_zero_overlap_one_does_not_bring_the_old_key_back(key_store: KeyStore) -> None:
    """`rotate --overlap-s 0` (a leaked key) won the compare and set; the other rotation had already written
    the old hash's entry good for a day, its undo deleted only its new hash, and `confirmed` took the
    entry's expiry: the leaked key worked for 24 h."""
    manager = KeyManager(key_store, rotate_overlap_s=86400.0)
    leaked, record = await manager.create("tenant-" + uuid.uuid4().hex[:6])
    stale = await key_store.get(record.key_id)
    assert stale is not None
    await manager.rotate(record.key_id, overlap_s=0.0)
    with pytest.raises(KeyChanged):
        await StaleRead(key_store, stale).rotate(record.key_id)
    gateway = Gateway(GatewaySettings(auth_required=True, key_cache_s=0.0), key_store, MemoryLimiter(WINDOW_S))
    with pytest.raises(StageError) as refused:
        await gateway.authenticate(request("leaked", api_key=leaked))
    assert refused.value.code is ErrorCode.unauthorized
    stored, entry = await key_store.get(record.key_id), await key_store.lookup(hash_key(leaked))
    assert stored is not None and (entry is None or entry.not_after == stored.hashes[hash_key(leaked)])  # Redis expiry too


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


async def held(limiter: Limiter, s: Scope, check: Redis) -> int:
    """The tokens `s`'s window holds: its running total, checked against the weights in its log."""
    if isinstance(limiter, MemoryLimiter):
        log = limiter._logs[s.tag]
        weights, total = sum(n for _, n in log.tokens.values()), log.total
    else:
        entries = await check.zrange(rate_keys(s)[1], 0, -1)
        weights, total = sum(int(e.rsplit(b"|", 1)[1]) for e in entries), int(await check.get(rate_keys(s)[2]) or 0)
    assert total == weights
    return total


def finished(rid: str, prompt_tokens: int, completion_tokens: int) -> Done:
    return Done(id=rid, reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop, tenant="acme", model=MODEL,
                created_at=1.0, usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))


async def test_completions_are_reserved_so_a_window_never_holds_more_than_tpm(
    make_limiter: Callable[[float], Limiter], settings: Settings
) -> None:
    """Completions were charged only at the end, and a charge never refuses: with tpm = 1000, 50 requests
    of a 10-token prompt in flight at once were all admitted, and the window held 50,500 tokens."""
    limiter, check = make_limiter(60.0), redis_client(with_gateway(settings, redis_timeout_s=2.0))
    store = MemoryKeyStore()
    gateway = Gateway(GatewaySettings(auth_required=True, key_cache_s=0.0, chars_per_token=1), store, limiter)
    keys = KeyManager(store, rotate_overlap_s=60)

    async def admit(key: str, name: str, max_tokens: int) -> None:  # a prompt of 10 tokens and 4 for its message
        await gateway.admit(request(name, api_key=key, messages=(ChatMessage("user", "x" * 10),),
                                    sampling=Sampling(max_tokens=max_tokens)))

    async def refusal(key: str, name: str, max_tokens: int) -> StageError:
        with pytest.raises(StageError) as refused:
            await admit(key, name, max_tokens)
        return refused.value

    try:
        raw, record = await keys.create("acme", tpm=1000)
        s = Scope("key", record.key_id)
        for i in range(10):  # each reserves 14 + 86
            await admit(raw, f"r{i}", 86)
        assert await held(limiter, s, check) == 1000
        full = await refusal(raw, "r10", 86)  # the 11th would take the window past the limit
        assert full.code is ErrorCode.rate_limited and full.retry_after_s is not None
        for i in range(10):  # each used all it reserved
            await gateway.finish(finished(f"acme/r{i}", 14, 86))
            assert await held(limiter, s, check) == 1000
        assert (await refusal(raw, "r11", 1)).code is ErrorCode.rate_limited

        raw, record = await keys.create("acme", tpm=1000)
        s = Scope("key", record.key_id)
        for i in range(10):
            await admit(raw, f"f{i}", 86)
        await gateway.finish(finished("acme/f0", 14, 36))  # 50 of its 100 unused: free again
        await gateway.finish(finished("acme/f0", 14, 36))  # (once)
        assert await held(limiter, s, check) == 950
        await admit(raw, "f10", 36)
        assert (await refusal(raw, "f11", 1)).code is ErrorCode.rate_limited

        never = await refusal(raw, "f12", 987)  # 1001 tokens can never fit: not a 429 to retry for ever
        assert never.code is ErrorCode.invalid_request and not never.retriable
        assert "max_tokens" in never.message and "1001" in never.message
    finally:
        await check.aclose()


@pytest.mark.parametrize("lost", ["tok", "toksum"])
@pytest.mark.parametrize("client", ["redis", "lean"])
async def test_a_lost_token_log_or_total_is_recomputed(settings: Settings, client: str, lost: str) -> None:
    """A scope's token total is a key beside its log: with one of them evicted, the total stayed wrong for as
    long as traffic kept the other alive. Without the total, each admission counted from 0 (over the limit;
    and negative once entries expired); without the log, the total was never decremented again (every
    request refused: for the global scope, everyone's)."""
    gateway = with_gateway(settings, redis_timeout_s=2.0)
    redis, check = (redis_client if client == "redis" else stage_redis)(gateway), redis_client(gateway)
    limiter, s = RedisLimiter(redis, 60.0), scope(tpm=100)
    log, total = rate_keys(s)[1], rate_keys(s)[2]
    try:
        assert await limiter.admit([s], rid(), 40, b"t", 10) is None
        assert await limiter.admit([s], rid(), 40, b"t", 10) is None
        await check.delete(log if lost == "tok" else total)
        if lost == "toksum":  # the log still holds 80
            assert await limiter.admit([s], rid(), 20, b"t", 10) is None
            refusal = await limiter.admit([s], rid(), 1, b"t", 10)
            assert refusal is not None and refusal.resource == "tokens"
            assert int(await check.get(total)) == 100
        else:  # the entries are gone: the total follows the log
            assert await limiter.admit([s], rid(), 90, b"t", 10) is None
            assert int(await check.get(total)) == 90
    finally:
        await redis.aclose()
        await check.aclose()


async def test_a_second_request_under_an_admitted_id_leaves_the_first_ones_ticket_and_entries(
    limiter: Limiter, settings: Settings
) -> None:
    """Every admission wrote the ticket, and a refused one released every scope that answered "admitted",
    a scope that found the id recorded included, and deleted the ticket: a second request under a running
    one's id (which ingest refuses: id in use) replaced its ticket, or, refused by a limit, deleted it and
    took the first out of the windows. The first was charged nothing."""
    check = redis_client(with_gateway(settings, redis_timeout_s=2.0))
    key, tenant, other_key, member = scope(rpm=10), scope("tenant", rpm=3, tpm=1000), scope(rpm=1), rid()
    try:
        assert await limiter.admit([key, tenant], member, 30, b"first", 10) is None
        assert await limiter.admit([key, tenant], member, 50, b"second", 10) is None  # found: not counted again
        assert await limiter.admit([other_key], rid(), 0, b"t", 10) is None
        refusal = await limiter.admit([other_key, tenant], member, 50, b"third", 10)  # another key's rpm is spent
        assert refusal is not None and refusal.scope == other_key and refusal.resource == "requests"
        assert await held(limiter, tenant, check) == 30
        assert await limiter.admit([tenant], rid(), 0, b"t", 10) is None
        assert await limiter.admit([tenant], rid(), 0, b"t", 10) is None  # the member and these two: 3
        assert await limiter.admit([tenant], rid(), 0, b"t", 10) is not None
        assert await limiter.take_ticket(member) == b"first"
    finally:
        await check.aclose()


async def test_a_redelivery_keeps_the_one_ticket_and_writes_none_once_it_was_taken(limiter: Limiter) -> None:
    """A redelivery after the request's charge wrote its ticket again, for a second charge."""
    s, member = scope(tpm=100), rid()
    assert await limiter.admit([s], member, 40, b"ticket", 10) is None
    assert await limiter.admit([s], member, 40, b"ticket", 10) is None  # the SDK's resend: the same bytes
    assert await limiter.admit([s], rid(), 60, b"t", 10) is None  # 40 counted once
    assert await limiter.take_ticket(member) == b"ticket"
    await limiter.charge([s], member, 40, 40, 0.0)
    assert await limiter.admit([s], member, 40, b"ticket", 10) is None
    assert await limiter.take_ticket(member) is None


async def test_a_request_under_a_running_ones_id_does_not_cut_its_charge(
    make_limiter: Callable[[float], Limiter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's case: a second request under the id of a running one, with a deadline of 5 s (ingest
    refuses it: id in use), replaced its ticket by one that lived 5 + 60 s; the first, ending 120 s in,
    was charged 0.0 (2.0 without the second). Here the grace is 0 and the deadline 0.5 s: the same in 1 s."""
    monkeypatch.setattr(gateway_module, "TICKET_GRACE_S", 0.0)
    store = MemoryKeyStore()
    prices = {MODEL: ModelPrice(prompt_per_1k=100.0, completion_per_1k=100.0)}
    limiter = make_limiter(60.0)
    gateway = Gateway(GatewaySettings(auth_required=True, key_cache_s=0.0, prices=prices), store, limiter)
    raw, record = await KeyManager(store, rotate_overlap_s=60).create("acme", budget=100.0)
    await gateway.admit(request("x", api_key=raw))
    await gateway.admit(request("x", api_key=raw, deadline_s=0.5, messages=(ChatMessage("user", "other"),)))
    await asyncio.sleep(1.1)
    await gateway.finish(finished("acme/x", 10, 10))
    assert await limiter.spent(Scope("key", record.key_id)) == pytest.approx(2.0)


class FirstReadLate:
    """A key store whose first `get` answers 10 ms late, with what it read when asked."""

    def __init__(self, store: KeyStore) -> None:
        self._store, self._late = store, True

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def get(self, key_id: str) -> KeyRecord | None:
        record = await self._store.get(key_id)
        if self._late:
            self._late = False
            await asyncio.sleep(0.01)
        return record


@pytest.mark.parametrize("first", ["rotate", "revoke"])
async def test_a_rotation_racing_a_revocation_never_brings_the_key_back(key_store: KeyStore, first: str) -> None:
    """The rotation read the record, the revocation saved it revoked and deleted its hashes, then the
    rotation saved the record it had read (not revoked, old and new hash live): the revoked key worked again."""
    manager = KeyManager(FirstReadLate(key_store), rotate_overlap_s=60.0)  # type: ignore[arg-type]
    raw, record = await KeyManager(key_store, rotate_overlap_s=60.0).create("tenant-" + uuid.uuid4().hex[:6])
    calls = [manager.rotate(record.key_id), manager.revoke(record.key_id)]
    rotated, revoked = await asyncio.gather(*(calls if first == "rotate" else calls[::-1]), return_exceptions=True)
    if first == "revoke":
        rotated, revoked = revoked, rotated
    assert isinstance(revoked, KeyRecord) and revoked.revoked
    assert isinstance(rotated, KeyChanged) or isinstance(rotated, tuple)  # refused, or saved before the revocation
    stored = await key_store.get(record.key_id)
    assert stored is not None and stored.revoked and stored.hashes == {}
    for key in [raw] + ([rotated[0]] if isinstance(rotated, tuple) else []):
        assert await key_store.lookup(hash_key(key)) is None
    if isinstance(rotated, KeyChanged):
        assert "again" in str(rotated)

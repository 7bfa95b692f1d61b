"""The gateway's decisions on in-memory stores: authentication, models, network rules, limits, budgets,
the failure mode, and what it forwards."""

from __future__ import annotations

import time

import pytest

from pipeline.errors import InfraUnavailable, StageError
from pipeline.gateway.config import ModelPrice, NetworkSettings, TenantPolicy
from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.keys import PREFIX
from pipeline.gateway.limits import Refusal, Scope
from pipeline.gateway.network import attest
from pipeline.metrics import GATEWAY_DEGRADED
from tests.unit.gateway.helpers import Rig, rig
from tests.unit.helpers import MODEL, request
from topics.errors import ErrorCode
from topics.requests import ChatMessage, Sampling
from topics.stream import Done, FinishReason, Usage

pytestmark = pytest.mark.asyncio


async def refusal(gateway_call: object) -> StageError:
    with pytest.raises(StageError) as caught:
        await gateway_call  # type: ignore[misc]
    return caught.value


async def test_a_valid_key_is_admitted_under_its_tenant_without_the_credential() -> None:
    r = rig()
    raw, record = await r.keys.create("acme")
    forwarded, principal = await r.gateway.admit(request(api_key=raw, tenant="someone-else"))
    assert forwarded.api_key is None and forwarded.tenant == "acme" and forwarded.key_id == record.key_id
    assert principal.name == "key:" + record.key_id


@pytest.mark.parametrize(
    "credential", [None, "' OR '1'='1", PREFIX + "A" * 43, PREFIX + "x", "eyJhbGciOiJub25lIn0.e30.", "a" * 100_000]
)
async def test_missing_or_invalid_credentials_are_unauthorized(credential: str | None) -> None:
    r = rig()
    await r.keys.create("acme")
    error = await refusal(r.gateway.admit(request(api_key=credential)))
    assert error.code is ErrorCode.unauthorized
    assert credential is None or credential not in error.message


async def test_without_auth_required_a_keyless_request_runs_as_the_anonymous_tenant() -> None:
    r = rig(auth_required=False, anonymous_tenant="public")
    forwarded, principal = await r.gateway.admit(request(tenant="acme"))
    assert forwarded.tenant == "public" and principal.name == "public"
    forwarded, _ = await r.gateway.admit(request("r1b", api_key="unused"))  # what OpenAI clients send
    assert forwarded.tenant == "public" and forwarded.api_key is None
    error = await refusal(r.gateway.admit(request("r2", api_key=PREFIX + "B" * 43)))
    assert error.code is ErrorCode.unauthorized  # a key that is given is always checked


async def test_revoked_and_rotated_out_keys_stop_working() -> None:
    r = rig(rotate_overlap_s=60)
    raw, record = await r.keys.create("acme")
    new, _ = await r.keys.rotate(record.key_id)
    await r.gateway.admit(request("a", api_key=raw))  # within the overlap
    r.clock.now += 61
    assert (await refusal(r.gateway.admit(request("b", api_key=raw)))).code is ErrorCode.unauthorized
    await r.gateway.admit(request("c", api_key=new))
    await r.keys.revoke(record.key_id)
    assert (await refusal(r.gateway.admit(request("d", api_key=new)))).code is ErrorCode.unauthorized


async def test_a_key_may_use_only_its_models_and_its_tenants_models() -> None:
    r = rig(tenants={"acme": TenantPolicy(models=("other",))})
    raw, _ = await r.keys.create("beta", models=("other",))
    assert (await refusal(r.gateway.admit(request(api_key=raw)))).code is ErrorCode.forbidden
    raw2, _ = await r.keys.create("acme")
    assert (await refusal(r.gateway.admit(request("r2", api_key=raw2)))).code is ErrorCode.forbidden
    assert request().model == MODEL


@pytest.mark.parametrize(
    ("ip", "agent", "tenant_policy", "allowed"),
    [
        ("10.0.0.5", "curl/8", TenantPolicy(), True),
        ("192.0.2.7", "curl/8", TenantPolicy(), False),  # global deny
        ("198.51.100.9", "curl/8", TenantPolicy(), False),  # geo block
        ("10.0.0.5", "EvilBot/1.0", TenantPolicy(), False),  # user agent
        ("10.0.0.5", "curl/8", TenantPolicy(allow_cidrs=("10.1.0.0/16",)), False),  # tenant allow list
        ("10.1.2.3", "curl/8", TenantPolicy(allow_cidrs=("10.1.0.0/16",), deny_cidrs=("10.1.2.0/24",)), False),
        ("2001:db8::1", "curl/8", TenantPolicy(), False),  # IPv6 deny
        ("::ffff:192.0.2.7", "curl/8", TenantPolicy(), False),  # an IPv4 client on a dual-stack socket
        ("::ffff:10.1.2.3", "curl/8", TenantPolicy(allow_cidrs=("10.1.0.0/16",)), True),
        (None, None, TenantPolicy(allow_cidrs=("10.0.0.0/8",)), False),  # unknown address fails an allow list
    ],
)
async def test_network_rules(ip: str | None, agent: str | None, tenant_policy: TenantPolicy, allowed: bool) -> None:
    network = NetworkSettings(deny_cidrs=("192.0.2.0/24", "2001:db8::/32"), geo_block={"XX": ("198.51.100.0/24",)},
                              deny_user_agents=(r"(?i)evilbot",))
    r = rig(network=network, tenants={"acme": tenant_policy})
    raw, _ = await r.keys.create("acme")
    call = r.gateway.admit(request(api_key=raw, client_ip=ip, user_agent=agent))
    if allowed:
        await call
    else:
        assert (await refusal(call)).code is ErrorCode.forbidden


async def test_client_info_counts_only_with_the_bridges_signature() -> None:
    r = rig(client_info_secret="s3cret", network=NetworkSettings(deny_cidrs=("192.0.2.0/24",)))
    raw, _ = await r.keys.create("acme")
    forged = request("f", api_key=raw, client_ip="192.0.2.1", client_attestation="00" * 32)
    await r.gateway.admit(forged)  # a forged claim is ignored: the address is unknown, not denied
    signed = request("s", api_key=raw, client_ip="192.0.2.1", client_attestation=attest("s3cret", "s", "192.0.2.1", None))
    assert (await refusal(r.gateway.admit(signed))).code is ErrorCode.forbidden


async def test_requests_per_minute_with_retry_after_and_the_window_sliding() -> None:
    r = rig()
    raw, _ = await r.keys.create("acme", rpm=3)
    for i in range(3):
        await r.gateway.admit(request(f"r{i}", api_key=raw))
        r.clock.now += 10
    error = await refusal(r.gateway.admit(request("r3", api_key=raw)))
    assert error.code is ErrorCode.rate_limited and error.rate_limit is not None
    assert error.retry_after_s == pytest.approx(30.0) and error.rate_limit.scope == "key"
    await r.gateway.admit(request("r0", api_key=raw))  # a redelivery of an admitted request is not counted again
    r.clock.now += 30.01
    await r.gateway.admit(request("r4", api_key=raw))


async def test_tokens_per_minute_reserve_the_prompt_and_max_tokens_and_charge_what_was_used() -> None:
    r = rig(chars_per_token=1)
    raw, _ = await r.keys.create("acme", tpm=100)
    await r.gateway.admit(request("a", api_key=raw, sampling=Sampling(max_tokens=85)))  # "hello there": 11 + 85
    error = await refusal(r.gateway.admit(request("b", api_key=raw)))  # 11 + 8 more: over 100
    assert error.code is ErrorCode.rate_limited and error.rate_limit is not None and error.rate_limit.resource == "tokens"
    await r.gateway.finish(Done(id="acme/a", reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop,
                                usage=Usage(prompt_tokens=11, completion_tokens=40), tenant="acme", model=MODEL, created_at=1.0))
    await r.gateway.admit(request("b", api_key=raw))  # 51 held: 45 unused tokens were given back
    big = await refusal(r.gateway.admit(request("c", api_key=raw, prompt="x" * 93, messages=())))  # 93 + 8 > 100
    assert big.code is ErrorCode.invalid_request and "lower max_tokens" in big.message


async def test_budgets_refuse_once_spend_reaches_them() -> None:
    r = rig(prices={MODEL: ModelPrice(prompt_per_1k=1.0, completion_per_1k=2.0)}, tenants={"acme": TenantPolicy(budget=10.0)})
    raw, record = await r.keys.create("acme", budget=0.5)
    await r.gateway.admit(request("a", api_key=raw))
    done = Done(id="acme/a", reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop,
                usage=Usage(prompt_tokens=100, completion_tokens=200), tenant="acme", model=MODEL, created_at=1.0)
    await r.gateway.finish(done)
    await r.gateway.finish(done)  # charged once
    assert await r.limiter.spent(Scope("key", record.key_id)) == pytest.approx(0.5)
    assert await r.limiter.spent(Scope("tenant", "acme")) == pytest.approx(0.5)
    assert (await refusal(r.gateway.admit(request("b", api_key=raw)))).code is ErrorCode.budget_exceeded


async def test_only_a_scope_with_a_budget_keeps_a_running_spend() -> None:
    """Every billed scope kept one, with no TTL in Redis (a key volatile-lru never evicts): one per JWT
    subject ever seen, and per key or tenant that no budget reads. llm.usage records every charge."""
    r = rig(prices={MODEL: ModelPrice(prompt_per_1k=1.0, completion_per_1k=2.0)}, tenants={"capped": TenantPolicy(budget=10.0)})
    free, free_record = await r.keys.create("acme")
    capped, capped_record = await r.keys.create("capped", budget=5.0)
    for rid, raw, tenant in (("a", free, "acme"), ("b", capped, "capped")):
        await r.gateway.admit(request(rid, api_key=raw))
        await r.gateway.finish(Done(id=f"{tenant}/{rid}", reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop,
                                    usage=Usage(prompt_tokens=100, completion_tokens=200), tenant=tenant, model=MODEL, created_at=1.0))
    assert await r.limiter.spent(Scope("key", capped_record.key_id)) == pytest.approx(0.5)
    assert await r.limiter.spent(Scope("tenant", "capped")) == pytest.approx(0.5)
    assert await r.limiter.spent(Scope("key", free_record.key_id)) == 0.0
    assert await r.limiter.spent(Scope("tenant", "acme")) == 0.0


async def priced_key() -> tuple[Rig, str, Scope]:
    """A gateway on the wall clock (requests' `created_at`) whose one key, of tenant acme, keeps its spend."""
    r = rig(prices={MODEL: ModelPrice(prompt_per_1k=100.0, completion_per_1k=100.0)})
    r.clock.now = time.time()
    raw, record = await r.keys.create("acme", budget=100.0)
    return r, raw, Scope("key", record.key_id)


def done(rid: str) -> Done:
    return Done(id=rid, reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop, tenant="acme", model=MODEL,
                usage=Usage(prompt_tokens=10, completion_tokens=10), created_at=1.0)


async def test_a_request_under_a_running_ones_id_does_not_replace_its_ticket() -> None:
    """The reviewer's case: a second request under a running one's id with deadline_s 5 (ingest refuses it,
    id in use, after the gateway admitted it as a redelivery) replaced the first's ticket by one that lived
    65 s: the first, ending 120 s in, was charged 0.0 instead of 2.0."""
    r, raw, key = await priced_key()
    await r.gateway.admit(request("x", api_key=raw))
    await r.gateway.admit(request("x", api_key=raw, deadline_s=5, messages=(ChatMessage("user", "other"),)))
    r.clock.now += 120
    await r.gateway.finish(done("acme/x"))
    assert await r.limiter.spent(key) == pytest.approx(2.0)


async def test_the_ticket_lives_until_the_deadline_counted_from_created_at() -> None:
    """Counted from now, the ticket of a request created 299 s ahead (ingest takes up to 300) with a
    deadline of 1 s lived 61 s, while the request could run 300 s: charged nothing."""
    r, raw, key = await priced_key()
    await r.gateway.admit(request("ahead", api_key=raw, created_at=r.clock.now + 299, deadline_s=1))
    r.clock.now += 250
    await r.gateway.finish(done("acme/ahead"))
    assert await r.limiter.spent(key) == pytest.approx(2.0)


async def test_the_prompt_estimate_counts_text_that_is_not_ascii_and_each_messages_markers() -> None:
    """UTF-8 bytes / 4 reserved 75 tokens for 100 CJK characters (about 180 for SmolLM2's tokenizer, 100 for
    larger ones), and nothing for 64 empty messages (each one a turn of role markers)."""
    r = rig()
    raw, _ = await r.keys.create("acme", tpm=100)
    cjk = request("cjk", api_key=raw, messages=(ChatMessage("user", "\u6211" * 100),), sampling=Sampling(max_tokens=1))
    error = await refusal(r.gateway.admit(cjk))  # at least one token a character: it can never fit in 100
    assert error.code is ErrorCode.invalid_request and "lower max_tokens" in error.message
    empty = request("empty", api_key=raw, messages=(ChatMessage("user", ""),) * 64, sampling=Sampling(max_tokens=1))
    assert (await refusal(r.gateway.admit(empty))).code is ErrorCode.invalid_request
    await r.gateway.admit(request("ascii", api_key=raw, messages=(ChatMessage("user", "x" * 300),), sampling=Sampling(max_tokens=1)))


class DownLimiter:
    async def admit(self, *args: object) -> Refusal | None:
        raise StoreUnavailable("redis: ConnectionError")

    async def charge(self, *args: object) -> None:
        raise StoreUnavailable("redis: ConnectionError")

    async def take_ticket(self, member: str) -> bytes | None:
        raise StoreUnavailable("redis: ConnectionError")

    async def spent(self, scope: Scope) -> float:
        raise StoreUnavailable("redis: ConnectionError")


@pytest.mark.parametrize("mode", ["open", "closed", "wait"])
async def test_redis_down_follows_the_failure_mode_and_is_counted(mode: str) -> None:
    r = rig(on_redis_down=mode)
    raw, _ = await r.keys.create("acme", rpm=1)
    r.gateway._limiter = DownLimiter()  # type: ignore[assignment]
    before = GATEWAY_DEGRADED.labels("limit", mode)._value.get()
    if mode == "open":
        await r.gateway.admit(request(api_key=raw))
    elif mode == "wait":  # the runner holds the request and tries again until Redis answers or its deadline
        with pytest.raises(InfraUnavailable):
            await r.gateway.admit(request(api_key=raw))
    else:
        error = await refusal(r.gateway.admit(request(api_key=raw)))
        assert error.code is ErrorCode.unavailable and error.retriable
    assert GATEWAY_DEGRADED.labels("limit", mode)._value.get() == before + 1
    await r.gateway.finish(Done(id="acme/r1", reply_to="x", chunks=0, digest="", finish_reason=FinishReason.stop, usage=Usage(),
                                tenant="acme", model=MODEL, created_at=1.0))


async def test_the_per_address_limit_counts_an_ipv6_client_by_its_64() -> None:
    r = rig(ip_rpm=1)
    raw, _ = await r.keys.create("acme")
    await r.gateway.admit(request("v6-a", api_key=raw, client_ip="2001:db8:1:2::1"))
    other = r.gateway.admit(request("v6-b", api_key=raw, client_ip="2001:db8:1:2:ffff::9"))  # same /64, new address
    assert (await refusal(other)).code is ErrorCode.rate_limited
    await r.gateway.admit(request("v6-c", api_key=raw, client_ip="2001:db8:1:3::1"))  # another /64


async def test_a_key_whose_record_is_revoked_is_refused_whatever_its_hash_entry_says() -> None:
    """A revoke racing a rotation: the revoke read the record before the rotation saved the new hash, so
    the new key's entry stayed (no expiry, "not revoked") while `sluice keys` called the key revoked."""
    import msgspec

    r = rig()
    raw, record = await r.keys.create("acme")
    store = r.keys._store
    stale = await store.lookup(next(iter(record.hashes)))
    await r.keys.revoke(record.key_id)
    await store.save(msgspec.structs.replace(stale.record, revoked=False))  # the racing rotation's write of the entry
    await store.save(msgspec.structs.replace(stale.record, revoked=True, hashes={}, verify_keys={}))  # revoke's record
    assert (await refusal(r.gateway.admit(request("after", api_key=raw)))).code is ErrorCode.unauthorized
    await r.keys.revoke(record.key_id)  # and revoking again works (it said "no active key")


async def test_a_tenant_named_after_anothers_hashed_name_has_scopes_of_its_own() -> None:
    import hashlib

    victim = Scope("tenant", "Acme Corp")  # a space: stored under its hash
    impostor = Scope("tenant", "h" + hashlib.sha256(b"Acme Corp").hexdigest()[:24])
    assert victim.tag != impostor.tag  # they shared rate windows, spend and budget
    assert Scope("tenant", "acme").tag == "tenant:acme"


async def test_a_key_recorded_under_a_tenant_name_the_rule_now_refuses_is_forbidden_at_once() -> None:
    """Keys created before the tenant rule (a name with a space was accepted) minted request ids the wire
    schema now refuses a stage later: no terminal event, the client waiting out its deadline."""
    import msgspec

    r = rig()
    raw, record = await r.keys.create("acme")
    store = r.keys._store
    entry = await store.lookup(next(iter(record.hashes)))
    await store.save(msgspec.structs.replace(entry.record, tenant="Acme Inc"))  # as an older sluice wrote it
    error = await refusal(r.gateway.admit(request("old", api_key=raw)))
    assert error.code is ErrorCode.forbidden and "tenant name" in error.message

"""Gateway: the decisions ingest asks for before admitting a request, and the charge emit reports.

    authenticate(request)   network rules -> who sent it (API key, JWT, a signed principal token in
                            place of either, from the bridge or the SDK: principal.py, or anonymous)
    admit(request)  network rules -> authenticate (API key, JWT, or anonymous) -> authorise the model
                    -> tenant network rules -> limits and budgets; returns the request to forward, with
                    the authenticated tenant and key id and without the credential; raises StageError.
    finish(event)   replaces the tokens reserved at admission (the prompt's estimate and max_tokens) by
                    the prompt and completion tokens used, and charges spend to the scopes with a budget.

Redis being away is a `StoreUnavailable`: limits follow `on_redis_down` (wait: the runner retries the
request until Redis answers or its deadline passes; open: admit; closed: refuse
with `unavailable`), authentication uses a cached lookup or refuses; every such decision is counted
in `sluice_gateway_degraded_total{operation,decision}`.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pipeline.errors import InfraUnavailable, StageError, Undeliverable
from pipeline.gateway import principal as principal_token
from pipeline.gateway.config import GatewaySettings, TenantPolicy
from pipeline.gateway.errors import StoreUnavailable
from pipeline.gateway.estimate import prompt_estimate
from pipeline.gateway.jwt_auth import InvalidToken, JwtVerifier, looks_like_jwt
from pipeline.gateway.keys import PREFIX, KeyEntry, KeyStore, confirmed, hash_key, tenant_name, well_formed
from pipeline.gateway.limits import Limiter, Refusal, Scope
from pipeline.gateway.network import Address, NetworkRules, attest, client_block, parse_ip
from pipeline.metrics import GATEWAY_DEGRADED
from topics.errors import ErrorCode
from topics.hops import request_key
from topics.registry import reply_topic
from topics.requests import Request
from topics.stream import Done, Failed, RateLimit

log = logging.getLogger(__name__)
CACHE_ENTRIES = 10_000
STALE_LIMIT_S = 300.0  # with Redis away, a cached key lookup this old is still used
TICKET_GRACE_S = 60.0
INVALID_KEY = "the API key is not valid"
RAW_KEY_REFUSED = ("this gateway does not take an API key in a Kafka record (gateway.raw_keys = \"refuse\"): "
                   "sign the request with the key instead, as sluice's SDK does")
SIGNED_LIFETIME_S = 3600.0  # state.ttl_s: how long ingest remembers a request it admitted


@dataclass(frozen=True)
class Principal:
    name: str  # "key:<id>", "jwt:<sub>" or "anonymous": what Envelope.principal records
    tenant: str
    key_id: str | None = None
    models: tuple[str, ...] = ()  # empty: no restriction
    key_scope: Scope | None = None


class Ticket(msgspec.Struct, frozen=True):
    """What admission remembers for the charge at the end: the scopes and the tokens it reserved."""

    scopes: list[tuple[str, str, bool]]  # (kind, name, billed: spend is added to it, `Scope.billed`)
    prompt_estimate: int
    max_tokens: int = 0  # reserved with the estimate (0: a ticket written before completions were reserved)


class Gateway:
    def __init__(
        self, settings: GatewaySettings, keys: KeyStore, limiter: Limiter, jwt: JwtVerifier | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._keys = keys
        self._limiter = limiter
        self._jwt = jwt
        self._clock = clock
        self._network = NetworkRules(settings.network, settings.tenants)
        self._cache: OrderedDict[str, tuple[KeyEntry, float]] = OrderedDict()
        self._ticket = msgspec.msgpack.Decoder(Ticket)

    async def aclose(self) -> None:
        """Closes the stores' connections (a Redis client), if they have any, and the JWT verifier's thread."""
        for store in (self._keys, self._limiter):
            if (close := getattr(store, "aclose", None)) is not None:
                await close()
        if self._jwt is not None:
            await self._jwt.aclose()

    async def authenticate(self, request: Request) -> Principal:
        """Network rules, then who sent the request; raises StageError (403, 401)."""
        ip, user_agent = self._client_info(request)
        if reason := self._network.refusal(ip, user_agent):
            raise StageError(ErrorCode.forbidden, reason)
        if request.principal_token is not None:
            return await self._by_token(request)
        if self._settings.raw_keys == "refuse" and request.api_key is not None and request.api_key.startswith(PREFIX):
            raise StageError(ErrorCode.unauthorized, RAW_KEY_REFUSED)
        return await self._authenticate(request.api_key)

    async def admit(self, request: Request, principal: Principal | None = None) -> tuple[Request, Principal]:
        """`principal`: what `authenticate` already returned for this request (ingest authenticates first
        when auth is required, so an unauthenticated caller learns nothing from validation errors)."""
        ip, _ = self._client_info(request)
        if principal is None:
            principal = await self.authenticate(request)
        policy = self._settings.tenants.get(principal.tenant, TenantPolicy())
        for allowed in (principal.models, policy.models):
            if allowed and request.model not in allowed:
                raise StageError(ErrorCode.forbidden, "these credentials may not use the requested model")
        if policy.replies and request.reply_to not in {reply_topic(r) for r in policy.replies}:
            # Not answered there: the reply topic is exactly what these credentials may not reach.
            raise Undeliverable("these credentials may not use the requested reply topic")
        if reason := self._network.tenant_refusal(ip, principal.tenant):
            raise StageError(ErrorCode.forbidden, reason)
        await self._limit(request, principal, policy, ip)
        forwarded = msgspec.structs.replace(
            request, api_key=None, principal_token=None, tenant=principal.tenant, key_id=principal.key_id,
            client_attestation=None,
        )
        return forwarded, principal

    async def finish(self, event: Done | Failed) -> None:
        """Charges a finished request's tokens and spend to the scopes it was admitted under (once)."""
        try:
            raw = await self._limiter.take_ticket(event.id)
            if raw is None:
                return
            ticket = self._ticket.decode(raw)
            usage = event.usage
            reserved = ticket.prompt_estimate + ticket.max_tokens
            tokens = usage.prompt_tokens + usage.completion_tokens
            price = self._settings.prices.get(event.model)
            spend = 0.0
            if price is not None:
                spend = (usage.prompt_tokens * price.prompt_per_1k + usage.completion_tokens * price.completion_per_1k) / 1000
            scopes = [Scope(kind, name, billed=billed) for kind, name, billed in ticket.scopes]  # type: ignore[arg-type]
            await self._limiter.charge(scopes, event.id, reserved, tokens, spend)
        except StoreUnavailable:
            GATEWAY_DEGRADED.labels("charge", "dropped").inc()
            log.warning("request %s: usage not charged, Redis unavailable", event.id)

    def _client_info(self, request: Request) -> tuple[Address | None, str | None]:
        """The bridge's client ip and user agent, if its signature holds (or no secret is configured)."""
        if request.client_ip is None and request.user_agent is None:
            return None, None
        secret = self._settings.client_info_secret
        if secret:
            expected = attest(secret, request.id, request.client_ip, request.user_agent)
            if not hmac.compare_digest(expected, request.client_attestation or ""):
                return None, None
        return parse_ip(request.client_ip), request.user_agent

    async def _authenticate(self, credential: str | None) -> Principal:
        """A sluice key or (if enabled) a JWT is always verified. Anything else, or nothing, is anonymous
        when auth is not required (OpenAI clients must send some key: "unused" is common), else refused."""
        if credential is not None and credential.startswith(PREFIX):
            return await self._by_key(credential)
        if credential is not None and self._jwt is not None and looks_like_jwt(credential):
            try:
                claims = await self._jwt.verify(credential)
            except InvalidToken as exc:  # a bad token: 401; the IdP's keys away (`KeysUnavailable`): 503, retriable
                raise StageError(exc.code, str(exc), retry_after_s=getattr(exc, "retry_after_s", None)) from None
            scope = Scope("key", "jwt:" + claims.subject)  # no budget: no spend kept (llm.usage has every charge)
            return Principal("jwt:" + claims.subject, claims.tenant, None, claims.models, scope)
        if not self._settings.auth_required:
            return Principal(self._settings.anonymous_tenant, self._settings.anonymous_tenant)  # name: the tenant
        if credential is None:
            raise StageError(ErrorCode.unauthorized, "an API key is required (Authorization: Bearer sk-sluice-...)")
        raise StageError(ErrorCode.unauthorized, INVALID_KEY)

    async def _by_token(self, request: Request) -> Principal:
        """A request with a signed principal instead of the credential (pipeline/gateway/principal.py):
        from the bridge (HMAC with the gateway secret) or a direct producer (signed with its key's own
        pair). A key's hash is looked up as a key's would be, so a key revoked since the request was
        signed is refused; a JWT's claims were verified by the bridge."""
        token = request.principal_token
        if token is not None and token.kind == "signed_key":
            return await self._by_signature(request)
        token = principal_token.verify(self._settings.client_info_secret, request)
        if token is None or request.api_key is not None:
            raise StageError(ErrorCode.unauthorized, "the credentials are not valid")
        self._check_expiry(request, token.expires_at)
        if token.kind == "jwt":
            if self._jwt is None or not token.tenant:
                raise StageError(ErrorCode.unauthorized, "the credentials are not valid")
            scope = Scope("key", "jwt:" + token.subject)
            return Principal("jwt:" + token.subject, token.tenant, None, token.models, scope)
        return await self._by_hash(token.subject)

    async def _by_signature(self, request: Request) -> Principal:
        """A direct producer's request signed with its key's own pair: the key's hash is looked up, and the
        signature checked with the public half the record keeps for that hash. A signature is good for
        this request only, until its deadline, and at most SIGNED_LIFETIME_S ahead: ingest remembers a
        request (so that the same bytes sent again are a redelivery) for about that long."""
        token = request.principal_token
        assert token is not None
        if request.api_key is not None:
            raise StageError(ErrorCode.unauthorized, "the credentials are not valid")
        self._check_expiry(request, token.expires_at)
        if token.expires_at - self._clock() > SIGNED_LIFETIME_S:
            raise StageError(ErrorCode.invalid_request, f"a signed request's deadline may be at most {SIGNED_LIFETIME_S:.0f} s away")
        entry = await self._lookup(token.subject)
        verify_key = entry.record.verify_keys.get(token.subject, "") if entry is not None else ""
        if entry is None or not verify_key or not principal_token.verify_signature(verify_key, request):
            raise StageError(ErrorCode.unauthorized, INVALID_KEY)
        return self._by_entry(entry)

    def _check_expiry(self, request: Request, expires_at: float) -> None:
        if self._clock() >= expires_at:
            if expires_at < request.created_at + request.deadline_s:  # a JWT that expired first
                raise StageError(ErrorCode.unauthorized, "the token has expired")
            raise StageError(ErrorCode.deadline_exceeded, "the request's deadline passed before it was admitted")

    async def _by_key(self, raw: str) -> Principal:
        if not well_formed(raw):
            raise StageError(ErrorCode.unauthorized, INVALID_KEY)
        return await self._by_hash(hash_key(raw))

    async def _by_hash(self, key_hash: str) -> Principal:
        return self._by_entry(await self._lookup(key_hash))

    def _by_entry(self, entry: KeyEntry | None) -> Principal:
        if entry is None or not entry.valid(self._clock()):
            raise StageError(ErrorCode.unauthorized, INVALID_KEY)
        r = entry.record
        if not tenant_name(r.tenant):
            # A key created before the tenant rule (a name with a space, say): its requests' ids would fail the
            # wire schema (topics.hops.REQUEST_ID) a stage later, with no terminal event. Refused here instead.
            raise StageError(ErrorCode.forbidden, "this key's tenant name is no longer accepted (no whitespace or "
                             "'/'); create a new key under a valid tenant name")
        scope = Scope("key", r.key_id, r.rpm, r.tpm, r.budget, billed=r.budget > 0)
        return Principal("key:" + r.key_id, r.tenant, r.key_id, r.models, scope)

    async def _lookup(self, key_hash: str) -> KeyEntry | None:
        now = self._clock()
        cached = self._cache.get(key_hash)
        if cached is not None and now - cached[1] < self._settings.key_cache_s:
            return cached[0]
        try:
            entry = await self._keys.lookup(key_hash)
            if entry is not None:
                entry = await confirmed(self._keys, key_hash, entry)  # once per `key_cache_s`
        except StoreUnavailable:
            if cached is not None and now - cached[1] < STALE_LIMIT_S:
                GATEWAY_DEGRADED.labels("auth", "cached").inc()
                return cached[0]
            waiting = self._settings.on_redis_down == "wait"
            GATEWAY_DEGRADED.labels("auth", "wait" if waiting else "closed").inc()
            if waiting:
                raise InfraUnavailable("credentials cannot be checked until Redis answers") from None
            raise StageError(ErrorCode.unavailable, "credentials cannot be checked right now", retry_after_s=1.0) from None
        self._cache.pop(key_hash, None)
        if entry is not None and self._settings.key_cache_s > 0:
            self._cache[key_hash] = (entry, now)
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return entry

    def scopes(self, principal: Principal, policy: TenantPolicy, ip: Address | None) -> list[Scope]:
        s = self._settings
        scopes = [principal.key_scope] if principal.key_scope is not None else []
        scopes.append(Scope("tenant", principal.tenant, policy.rpm, policy.tpm, policy.budget, billed=policy.budget > 0))
        if ip is not None and (s.ip_rpm or s.ip_tpm):
            scopes.append(Scope("ip", client_block(ip), s.ip_rpm, s.ip_tpm))
        if s.global_rpm or s.global_tpm:
            scopes.append(Scope("global", "all", s.global_rpm, s.global_tpm))
        return scopes

    async def _limit(self, request: Request, principal: Principal, policy: TenantPolicy, ip: Address | None) -> None:
        scopes = self.scopes(principal, policy, ip)
        estimate = prompt_estimate(request, self._settings.chars_per_token)
        # A request reserves all it may use, so the requests in flight cannot take a window past `tpm`
        # (completions charged only at the end added up to max_tokens each over it); `finish` gives back
        # what it did not use.
        max_tokens = request.sampling.max_tokens
        ticket = msgspec.msgpack.encode(Ticket([(sc.kind, sc.name, sc.billed) for sc in scopes], estimate, max_tokens))
        try:
            member = request_key(principal.tenant, request.id)  # a new id is a new request, per tenant
            refusal = await self._limiter.admit(scopes, member, estimate + max_tokens, ticket, self._ticket_ttl(request))
        except StoreUnavailable:
            decision = self._settings.on_redis_down
            GATEWAY_DEGRADED.labels("limit", decision).inc()
            if decision == "open":
                return
            if decision == "wait":
                raise InfraUnavailable("limits cannot be checked until Redis answers") from None
            raise StageError(ErrorCode.unavailable, "limits cannot be checked right now", retry_after_s=1.0) from None
        if refusal is not None:
            raise refused(refusal, estimate, max_tokens)

    def _ticket_ttl(self, request: Request) -> float:
        """The ticket outlives the request's deadline, which counts from its `created_at` (up to
        ingest.MAX_CLOCK_SKEW_S ahead), not from now: counted from now, a request created 299 s ahead
        with a deadline of 1 s kept its ticket 61 s and could run 300 s, then was charged nothing."""
        return max(request.created_at + request.deadline_s - self._clock(), request.deadline_s) + TICKET_GRACE_S


def refused(refusal: Refusal, prompt_estimate: int, max_tokens: int) -> StageError:
    scope = refusal.scope.kind
    if refusal.resource == "budget":
        return StageError(ErrorCode.budget_exceeded, f"the {scope}'s budget is spent")
    if refusal.retry_after_s is None:  # more than the limit: it can never fit, a retry (429) would never pass
        return StageError(ErrorCode.invalid_request, (
            f"this request may use {prompt_estimate + max_tokens} tokens (a prompt of about {prompt_estimate} and "
            f"max_tokens {max_tokens}), over this {scope}'s limit of {int(refusal.limit)} tokens per minute: "
            "lower max_tokens (or shorten the prompt)"))
    info = RateLimit(scope, refusal.resource, int(refusal.limit), refusal.remaining, round(refusal.retry_after_s, 3))
    message = f"rate limit reached: {refusal.resource} per minute for this {scope}"
    return StageError(ErrorCode.rate_limited, message, retry_after_s=info.reset_s, rate_limit=info)

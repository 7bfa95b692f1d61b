"""`[gateway]` in sluice.toml: authentication, limits, budgets, network rules, TLS, Kafka SASL.

Read once by `pipeline.settings.load()` (which also applies the SLUICE_KAFKA_USER, SLUICE_KAFKA_PASSWORD
and SLUICE_GATEWAY_SECRET environment variables) and validated there. A limit of 0 means "no limit".
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pipeline.gateway.hosts import HostEntryError, parse_entry
from topics.requests import MAX_TENANT_CHARS

# The longest overlap after `keys rotate`, as `--overlap-s` allows it (gateway/keys.py): past it the old key's
# expiry is centuries away (or, at inf, no Redis expiry at all) while the operator believes it retired.
MAX_ROTATE_OVERLAP_S = 366 * 86400.0
MAX_JWT_LEEWAY_S = 300.0  # clock skew, not a longer life: PyJWT took NaN or inf as "never expires, always valid"


@dataclass(frozen=True)
class TenantPolicy:
    """Limits for every request of one tenant together; keys of the tenant have their own on top."""

    rpm: int = 0
    tpm: int = 0
    budget: float = 0.0  # currency units, spent since the budget was set (without one no spend is kept)
    models: tuple[str, ...] = ()  # empty: every configured model
    allow_cidrs: tuple[str, ...] = ()  # non-empty: only these client addresses
    deny_cidrs: tuple[str, ...] = ()
    replies: tuple[str, ...] = ()  # reply topic names (`replies`) this tenant may name; empty: any of them


@dataclass(frozen=True)
class ModelPrice:
    prompt_per_1k: float = 0.0
    completion_per_1k: float = 0.0


@dataclass(frozen=True)
class JwtSettings:
    enabled: bool = False
    algorithms: tuple[str, ...] = ("RS256",)  # pinned: a token with any other `alg` is refused
    issuer: str = ""
    audience: str = ""
    jwks_file: str = ""  # a JWKS JSON file (relative to the repository root or absolute)
    jwks_url: str = ""  # or an https:// URL the operator configured (http:// only to loopback); fetched by PyJWT
    leeway_s: float = 0.0  # clock skew allowed on `exp` and `nbf`, 0 to MAX_JWT_LEEWAY_S (NaN or inf turned them off)
    tenant_claim: str = "tenant"
    models_claim: str = "models"  # optional claim: a list restricting the models


def jwks_url_problem(url: str) -> str | None:
    """Why `url` may not be the JWKS URL, or None. PyJWT fetches it with urllib, which also opens http://,
    file:// and data: URLs; whoever can answer for the URL can sign tokens, so only https:// is taken,
    and plain http:// only to a loopback host (an IdP or test server on this machine, no network path)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return "is not a URL"
    if parts.scheme == "https" and host:
        return None
    if parts.scheme == "http" and host and _loopback(host):
        return None
    # scheme and host only: a URL's user info may hold a secret
    return (f"must be an https:// URL (plain http:// only to a loopback host: localhost, 127.0.0.0/8, ::1), "
            f"got scheme {parts.scheme!r}, host {host!r}")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class NetworkSettings:
    """Global rules; tenants add their own CIDR lists. No GeoIP database exists offline, so a geo-block
    is a named list of CIDRs the operator maintains (e.g. from their provider's published ranges)."""

    allow_cidrs: tuple[str, ...] = ()
    deny_cidrs: tuple[str, ...] = ()
    geo_block: dict[str, tuple[str, ...]] = field(default_factory=dict)  # region name -> CIDRs
    deny_user_agents: tuple[str, ...] = ()  # regular expressions, matched with re.search


@dataclass(frozen=True)
class TlsSettings:
    """The bridge's TLS. With `client_ca` set, clients must present a certificate it signed (mTLS)."""

    certfile: str = ""
    keyfile: str = ""
    client_ca: str = ""


@dataclass(frozen=True)
class KafkaSecurity:
    """How sluice's clients authenticate to the broker (the secure profile: SASL/SCRAM)."""

    protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = "SCRAM-SHA-256"
    username: str = ""
    password: str = field(default="", repr=False)  # better from SLUICE_KAFKA_PASSWORD than from the file
    # SASL_SSL: the CA file (PEM) that signed the broker's certificate; empty: the system's trusted CAs
    cafile: str = ""


@dataclass(frozen=True)
class GatewaySettings:
    auth_required: bool = False  # false: a request without credentials runs as `anonymous_tenant`
    anonymous_tenant: str = "default"
    # "wait": hold the request (retried with backoff until its deadline) until Redis answers again;
    # "closed": refuse at once with 503 `unavailable`; "open": admit without limits.
    on_redis_down: Literal["wait", "open", "closed"] = "wait"
    redis_timeout_s: float = 0.25
    key_cache_s: float = 5.0  # how long ingest reuses a key lookup; also how late a revocation may bite
    # A sluice key written into a request by a direct producer stays in Kafka's files as long as the topic's
    # retention. "refuse": such a request is refused (401) and the producer must sign instead, as the SDK
    # does (docs/security.md); "accept": it is verified like any key.
    raw_keys: Literal["accept", "refuse"] = "accept"
    rotate_overlap_s: float = 86400.0  # after `keys rotate`, the old key works this long
    window_s: float = 60.0  # the sliding window of every rpm/tpm limit
    chars_per_token: int = 4  # prompt tokens estimated at admission (bytes / this); corrected at the end
    global_rpm: int = 0
    global_tpm: int = 0
    ip_rpm: int = 0
    ip_tpm: int = 0
    client_info_secret: str = field(default="", repr=False)  # HMAC key for the bridge's client ip/user agent; empty: trusted
    allowed_hosts: tuple[str, ...] = ()  # Host headers the bridge answers: `host` (any port) or `host:port`; empty: any
    # (loopback names only when the bridge listens on a loopback address)
    allowed_origins: tuple[str, ...] = ()  # web origins (`https://app.example.com`) whose pages may call the API
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    prices: dict[str, ModelPrice] = field(default_factory=dict)
    jwt: JwtSettings = field(default_factory=JwtSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)

    def problems(self, models: Collection[str] | None = None, replies: Collection[str] | None = None) -> list[str]:
        """What is wrong with these settings, as messages for SettingsError. `models` and `replies`: the
        configured ones, which every tenant's lists (and, where a tenant has a budget, every price) must
        name; None: not checked."""
        found = self._names_problems(models, replies)
        cidrs = [*self.network.allow_cidrs, *self.network.deny_cidrs]
        cidrs += [c for block in self.network.geo_block.values() for c in block]
        cidrs += [c for t in self.tenants.values() for c in (*t.allow_cidrs, *t.deny_cidrs)]
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                found.append(f"gateway: {cidr!r} is not a CIDR")
        for pattern in self.network.deny_user_agents:
            try:
                re.compile(pattern)
            except re.error as exc:
                found.append(f"gateway.network.deny_user_agents: {pattern!r}: {exc}")
        for entry in self.allowed_hosts:
            try:
                parse_entry(entry)
            except HostEntryError as exc:
                found.append(f"gateway.allowed_hosts: {exc}")
        for origin in self.allowed_origins:
            if not re.fullmatch(r"https?://[^/\s]+/?", origin):
                found.append(f"gateway.allowed_origins: {origin!r} is not an origin (scheme://host[:port])")
        if self.jwt.enabled and not (self.jwt.jwks_file or self.jwt.jwks_url):
            found.append("gateway.jwt: enabled needs jwks_file or jwks_url")
        if self.jwt.enabled and self.jwt.jwks_url and (problem := jwks_url_problem(self.jwt.jwks_url)):
            found.append(f"gateway.jwt.jwks_url: {problem}")
        if self.jwt.enabled and (not self.jwt.issuer or not self.jwt.audience):
            found.append("gateway.jwt: enabled needs issuer and audience")
        if not 0 <= self.jwt.leeway_s <= MAX_JWT_LEEWAY_S:  # NaN fails too
            found.append(f"gateway.jwt.leeway_s must be 0 to {MAX_JWT_LEEWAY_S:.0f} seconds, got {self.jwt.leeway_s}")
        if {a.lower() for a in self.jwt.algorithms} & {"none", ""}:
            found.append("gateway.jwt.algorithms may not include 'none'")
        if bool(self.tls.certfile) != bool(self.tls.keyfile) or (self.tls.client_ca and not self.tls.certfile):
            found.append("gateway.tls: certfile and keyfile go together; client_ca needs them")
        if self.kafka.protocol != "PLAINTEXT" and not (self.kafka.username and self.kafka.password):
            found.append("gateway.kafka: SASL needs username and password (SLUICE_KAFKA_USER/SLUICE_KAFKA_PASSWORD)")
        if self.kafka.cafile and self.kafka.protocol != "SASL_SSL":
            found.append("gateway.kafka.cafile is for protocol = \"SASL_SSL\" only")
        elif self.kafka.cafile and not Path(self.kafka.cafile).is_file():  # else every Kafka client fails to start
            found.append(f"gateway.kafka.cafile: no such file {self.kafka.cafile!r}")
        if not (self.window_s > 0 and self.chars_per_token >= 1 and self.redis_timeout_s > 0):  # NaN fails too
            found.append("gateway: window_s, chars_per_token and redis_timeout_s must be positive")
        if not 0 <= self.key_cache_s <= 3600:  # inf: a revoked key would work for ever in every ingest that saw it
            found.append(f"gateway.key_cache_s must be 0 to 3600 seconds, got {self.key_cache_s}")
        # imported here: keys.py needs `cryptography`, which Triton's own environment (numpy < 2, for sluice_llm,
        # which reads these settings) does not have
        from pipeline.gateway.keys import tenant_name

        if not tenant_name(self.anonymous_tenant):  # in every keyless request's id: topics.hops.REQUEST_ID
            found.append(f"gateway.anonymous_tenant must be printable, without '/' or whitespace, "
                         f"1 to {MAX_TENANT_CHARS} characters, got {self.anonymous_tenant!r}")
        if not 0 <= self.rotate_overlap_s < MAX_ROTATE_OVERLAP_S:  # NaN and inf fail too
            found.append(f"gateway.rotate_overlap_s must be 0 or more seconds, under {MAX_ROTATE_OVERLAP_S:.0f} (366 days), "
                         f"got {self.rotate_overlap_s}")
        return found

    def _names_problems(self, models: Collection[str] | None, replies: Collection[str] | None) -> list[str]:
        """Tenants' model and reply lists naming nothing configured (a typo there would refuse every request
        the list was meant to admit), and prices naming no configured model while a tenant budget is set (the
        budget would never be spent on the model the price was meant for)."""
        found = []
        for tenant, policy in self.tenants.items():
            if models is not None and (unknown := sorted(set(policy.models) - set(models))):
                found.append(f"gateway.tenants.{tenant}.models: {unknown} are not configured models ({', '.join(models)})")
            if replies is not None and (unknown := sorted(set(policy.replies) - set(replies))):
                found.append(f"gateway.tenants.{tenant}.replies: {unknown} are not in replies ({', '.join(replies)})")
        # Only where a tenant here has a budget: configs that swap the backends keep the shipped price
        # (tests/chaos/harness.py), and keys' budgets live in Redis, out of load's sight.
        if models is not None and any(policy.budget for policy in self.tenants.values()):
            for model in sorted(set(self.prices) - set(models)):
                found.append(f"gateway.prices.{model!r}: no backend serves this model ({', '.join(models)}), "
                             "so a tenant's budget would never be charged for the one meant")
        return found

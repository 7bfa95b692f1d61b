"""Network rules: CIDR allow and deny lists (global and per tenant), geo-block lists, user-agent patterns.

No GeoIP database can be had offline, so a geo-block is a named list of CIDRs in the config; a refusal
names the list. A request without a known client address (a Kafka producer, or a bridge signature that
does not verify) matches no deny list and fails every non-empty allow list.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable

from pipeline.gateway.config import NetworkSettings, TenantPolicy

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def parse_ip(value: str | None) -> Address | None:
    if not value:
        return None
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return None
    # An IPv4 client of a dual-stack socket arrives as ::ffff:a.b.c.d: the IPv4 lists must still see it.
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def client_block(ip: Address) -> str:
    """The per-address rate-limit scope: the address itself for IPv4, its /64 for IPv6 (one subscriber's
    allocation; counting each IPv6 address apart would let a client rotate through 2^64 of them)."""
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _within(ip: Address, networks: tuple[Network, ...]) -> bool:
    return any(ip.version == n.version and ip in n for n in networks)


class NetworkRules:
    def __init__(self, network: NetworkSettings, tenants: dict[str, TenantPolicy]) -> None:
        self._allow = _networks(network.allow_cidrs)
        self._deny = _networks(network.deny_cidrs)
        self._geo = {name: _networks(cidrs) for name, cidrs in network.geo_block.items()}
        self._agents = tuple(re.compile(p) for p in network.deny_user_agents)
        self._tenants = {t: (_networks(p.allow_cidrs), _networks(p.deny_cidrs)) for t, p in tenants.items()}

    def refusal(self, ip: Address | None, user_agent: str | None) -> str | None:
        """Why the global rules refuse this caller (a message for the client), or None. Checked before
        authentication, so a blocked address costs no key lookup."""
        if user_agent is not None and any(p.search(user_agent) for p in self._agents):
            return "this client's user agent is not allowed"
        for region, networks in self._geo.items():
            if ip is not None and _within(ip, networks):
                return f"requests from this region ({region}) are not allowed"
        return _address_refusal(ip, self._allow, self._deny)

    def tenant_refusal(self, ip: Address | None, tenant: str) -> str | None:
        allow, deny = self._tenants.get(tenant, ((), ()))
        return _address_refusal(ip, allow, deny)


def _address_refusal(ip: Address | None, allow: tuple[Network, ...], deny: tuple[Network, ...]) -> str | None:
    if allow and (ip is None or not _within(ip, allow)):
        return "requests from this address are not allowed"
    if ip is not None and _within(ip, deny):
        return "requests from this address are not allowed"
    return None


def attest(secret: str, request_id: str, ip: str | None, user_agent: str | None) -> str:
    """The bridge's signature over the client information it puts on a request."""
    message = "\n".join((request_id, ip or "", user_agent or "")).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()

"""`gateway.allowed_hosts`: the Host headers the bridge answers.

An entry is `host` (any port) or `host:port` (that port only); `host` is a DNS name, `*.domain` (any
subdomain), an IPv4 address or a bracketed IPv6 address (`[::1]`, `[::1]:8080`); `*` alone allows any.
Pure functions: `parse_entry` validates one entry (settings call it), `allowed` matches a header.
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_NAME = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*\.?")


class HostEntryError(ValueError):
    """An allowed_hosts entry that is not `host` or `host:port`."""


def split(value: str) -> tuple[str, int | None]:
    """("example.com", 8080) from "example.com:8080"; ("::1", None) from "[::1]"; the host lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise HostEntryError(f"{value!r}: an IPv6 address goes in brackets, e.g. [::1]:8080")
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text = value.partition(":")
        port_text = port_text if colon else None
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise HostEntryError(f"{value!r}: the port must be a number from 1 to 65535")
        port = int(port_text)
    return host, port


def parse_entry(entry: str) -> tuple[str, int | None]:
    """A validated (host, port or None) from one allowed_hosts entry."""
    if entry.strip() == "*":
        return "*", None
    host, port = split(entry)
    if entry.strip().startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise HostEntryError(f"{entry!r}: {host!r} is not an IPv6 address") from None
    elif not _NAME.fullmatch(host):
        raise HostEntryError(f"{entry!r} is not `host` or `host:port` (a DNS name, *.domain, an IPv4 address or [IPv6])")
    return host, port


def allowed(header: str, entries: tuple[tuple[str, int | None], ...]) -> bool:
    """Whether a Host header matches one of the parsed entries (no entries: every header)."""
    if not entries:
        return True
    try:
        host, port = split(header)
    except HostEntryError:
        return False
    host = host.rstrip(".")
    for want_host, want_port in entries:
        if want_host == "*":
            return True
        if want_port is not None and port != want_port:
            continue
        want = want_host.rstrip(".")
        if host == want or (want.startswith("*.") and host.endswith(want[1:])):
            return True
    return False


__all__ = ["HostEntryError", "allowed", "parse_entry", "split"]

"""Strict reading of sluice.toml: every key must be one the settings dataclasses declare.

msgspec's `forbid_unknown_fields` exists only for `msgspec.Struct`; the settings are frozen dataclasses
(shared by every package's config), so the check is done here, over the raw TOML, before conversion:

    unknown_keys(raw, Settings)   -> ["`bridge.replies` is not a key of [bridge] (allowed: host, port, ...)"]
    describe(Settings, "$.state.store") -> "one of 'redis', 'memory'" (what a failed conversion wanted)
    masked(settings)              -> the settings as plain data, secrets replaced by "***"
    mask_url("https://u:pw@host/v1?key=k") -> "https://u:***@host/v1?***"

Pure functions over types and data: no I/O.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import msgspec

SECRET_FIELDS = frozenset({"password", "client_info_secret", "metrics_token"})  # field names whose values are masked
MASK = "***"


def unknown_keys(raw: object, cls: Any, where: str = "") -> list[str]:
    """One message per key in `raw` that `cls` (a settings type) does not declare, at any depth."""
    cls = _unwrap_optional(cls)
    if dataclasses.is_dataclass(cls) and isinstance(raw, dict):
        hints = typing.get_type_hints(cls)
        allowed = [f.name for f in dataclasses.fields(cls)]
        found = []
        for key, value in raw.items():
            path = f"{where}.{key}" if where else key
            if key not in hints:
                table = f"[{where}]" if where else "the top level"
                found.append(f"`{path}` is not a key of {table} (allowed: {', '.join(allowed)})")
                continue
            found += unknown_keys(value, hints[key], path)
        return found
    origin = get_origin(cls)
    if origin is tuple and isinstance(raw, list):
        item = get_args(cls)[0]
        return [m for i, value in enumerate(raw) for m in unknown_keys(value, item, f"{where}[{i}]")]
    if origin is dict and isinstance(raw, dict):
        item = get_args(cls)[1]
        return [m for key, value in raw.items() for m in unknown_keys(value, item, f"{where}.{key}")]
    return []


def describe(cls: Any, json_path: str) -> str | None:
    """What the field at msgspec's `$.a.b[0].c` accepts, for a Literal (else None)."""
    current: Any = cls
    for name, _ in re.findall(r"\.([^.\[]+)|(\[[^\]]*\])", json_path.removeprefix("$")):
        current = _unwrap_optional(current)
        if name and dataclasses.is_dataclass(current):
            current = typing.get_type_hints(current).get(name)
        elif get_origin(current) in (dict, tuple):
            current = get_args(current)[1 if get_origin(current) is dict else 0]
        else:
            return None
    current = _unwrap_optional(current)
    if get_origin(current) is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(current))
    return None


def masked(settings: Any) -> Any:
    """The settings as plain data, every field with its effective value (defaults included), with every
    secret value replaced by MASK: a field in SECRET_FIELDS, and the password and query string of every
    value shaped like a URL (`mask_url`), whatever its field is named (redis.url, a backend's base_url,
    gateway.jwt.jwks_url, observability.otlp_endpoint, and any added later).

    `dataclasses.asdict` first, not msgspec.to_builtins alone: a dataclass msgspec.convert built holds only
    the keys the file gave in its `__dict__` (the defaults are read from the class), and to_builtins
    walks `__dict__`, so it would leave out every value the file does not set."""
    return _mask(msgspec.to_builtins(dataclasses.asdict(settings)))


def _mask(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: (MASK if k in SECRET_FIELDS and v else _mask(v)) for k, v in data.items()}
    if isinstance(data, list | tuple):  # to_builtins leaves a tuple (backends, pools) a tuple
        return [_mask(v) for v in data]
    if isinstance(data, str):
        return mask_url(data)
    return data


# scheme://authority, then the path, then a query string or fragment (RFC 3986's split)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)([^?#]*)([?#].*)?", re.DOTALL)


def mask_url(value: str) -> str:
    """A URL with its credentials replaced by MASK: the userinfo's password (`redis://user:secret@host`
    -> `redis://user:***@host`), a userinfo without one whole (it is a token: `https://***@host`), and the
    query string and fragment (`?api_key=...` -> `?***`). Any other string is returned as it is."""
    match = _URL.fullmatch(value)
    if match is None:
        return value
    scheme, authority, path, query = match.groups()
    userinfo, at, host = authority.rpartition("@")  # the last @: a password may hold one unescaped
    if at:
        user, colon, _ = userinfo.partition(":")
        authority = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    return f"{scheme}{authority}{path}{query[0] + MASK if query else ''}"


def _unwrap_optional(cls: Any) -> Any:
    if get_origin(cls) in (Union, types.UnionType):
        args = [a for a in get_args(cls) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return cls


__all__ = ["MASK", "SECRET_FIELDS", "describe", "mask_url", "masked", "unknown_keys"]

"""Strict reading of sluice.toml: every key must be one the settings dataclasses declare.

msgspec's `forbid_unknown_fields` exists only for `msgspec.Struct`; the settings are frozen dataclasses
(shared by every package's config), so the check is done here, over the raw TOML, before conversion:

    unknown_keys(raw, Settings)   -> ["`bridge.replies` is not a key of [bridge] (allowed: host, port, ...)"]
    describe(Settings, "$.state.store") -> "one of 'redis', 'memory'" (what a failed conversion wanted)
    masked(settings)              -> the settings as plain data, secrets replaced by "***"

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
    secret value replaced by MASK.

    `dataclasses.asdict` first, not msgspec.to_builtins alone: a dataclass msgspec.convert built holds only
    the keys the file gave in its `__dict__` (the defaults are read from the class), and to_builtins
    walks `__dict__`, so it would leave out every value the file does not set."""
    return _mask(msgspec.to_builtins(dataclasses.asdict(settings)))


def _mask(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: (MASK if k in SECRET_FIELDS and v else _mask_url(v) if k == "url" else _mask(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [_mask(v) for v in data]
    return data


def _mask_url(value: Any) -> Any:
    """`redis://user:secret@host` -> `redis://user:***@host`."""
    if not isinstance(value, str):
        return _mask(value)
    return re.sub(r"^([a-z][a-z0-9+.-]*://[^:/@]*:)[^@/]*@", rf"\g<1>{MASK}@", value)


def _unwrap_optional(cls: Any) -> Any:
    if get_origin(cls) in (Union, types.UnionType):
        args = [a for a in get_args(cls) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return cls


__all__ = ["MASK", "SECRET_FIELDS", "describe", "masked", "unknown_keys"]

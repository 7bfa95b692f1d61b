"""Per-request state: the StateStore protocol and its in-memory implementation.

State is a small hash of byte fields per key (a request id, a stream id), and every key has a TTL, so
state a crashed worker left behind goes away by itself. A write "refreshes" the TTL: after it the key has
at least half of `ttl_s` left (the memory store sets all of it; the Redis store only when less than half
is left, which spares Redis a command per call). The one field with a meaning of its own is
`owner`: `take` makes a worker the owner whoever held the key before, and `write(..., owner=...)` is
fenced on it, so a worker that lost a request to another (a rebalance, a redelivery) cannot overwrite
the new owner's state. `claim` sets a field once (an event emitted once, a charge made once), and
`advance` writes a position that never moves back (what a worker recorded is never undone by a late
write of an earlier position, from the same worker or its predecessor).

A key that has no fields does not exist (as in Redis): writing no fields to a missing key creates nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Protocol

OWNER = "owner"  # the field `take` sets and `write(..., owner=...)` checks


class StateStore(Protocol):
    """Shared per-request state. Implementations: `MemoryStateStore` and `redis_store.RedisStateStore`;
    the Redis one raises `pipeline.errors.InfraUnavailable` when Redis cannot be reached. Each call is
    atomic: two workers calling at once see one call happen entirely before the other."""

    async def read(self, key: str) -> dict[str, bytes]:
        """All fields of `key` ({} when absent or expired)."""

    async def write(self, key: str, fields: Mapping[str, bytes], *, owner: str | None = None) -> bool:
        """Sets `fields` and refreshes the key's TTL. With `owner`: only while the key's "owner" field equals
        `owner`; otherwise (another owner took it, or the key is gone) writes nothing and returns False (fenced).
        Without owner: always writes, returns True."""

    async def advance(
        self, key: str, field: str, position: int, fields: Mapping[str, bytes], *, owner: str,
        always: Mapping[str, bytes] | None = None,
    ) -> bool:
        """A fenced write of a position: while the key's owner is `owner`, sets `field` to `position` (as
        decimal bytes) together with `fields` if it holds less (absent: 0), else writes nothing of them;
        sets `always` in either case (a request's ending, recorded in the same round trip as its last
        position); refreshes the TTL either way. True when the key now holds `position` or a later one;
        False when fenced."""

    async def amend(self, key: str, fields: Mapping[str, bytes]) -> bool:
        """Sets `fields` (and refreshes the TTL) only if `key` exists; True when written. A write for an id
        nobody admitted (a cancellation anyone may send) leaves nothing behind."""

    async def claim(self, key: str, field: str, value: bytes) -> bool:
        """Sets `field` only if it is absent (and refreshes the TTL); True when this call set it. A claim
        that returns False writes nothing, the TTL included."""

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        """Makes `owner` the key's owner whoever held it (field "owner"), refreshes the TTL, and returns the
        fields as they were just before (the previous "owner" included, if any)."""

    async def forget(self, key: str) -> None:
        """Deletes the key."""

    async def aclose(self) -> None: ...


class MemoryStateStore:
    """The same semantics as the Redis store, for one process (unit tests, the embedded demo).

    Keys sit in an OrderedDict in the order of their last write. Every write sets the expiry to
    `now + ttl_s` on a clock that never goes back, so that order is also expiry order: expired keys are
    dropped from the front, and past `max_keys` the key written longest ago is evicted first.
    Atomic because no method awaits: one event loop runs each call to its end.
    """

    def __init__(
        self, ttl_s: float = 3600.0, *, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0 or max_keys < 1:
            raise ValueError(f"MemoryStateStore needs ttl_s > 0 and max_keys >= 1, got {ttl_s} and {max_keys}")
        self._ttl = ttl_s
        self._max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[str, tuple[dict[str, bytes], float]] = OrderedDict()  # key -> (fields, expires at)

    def __len__(self) -> int:
        """Keys held, expired ones not yet dropped included."""
        return len(self._keys)

    def _live(self, key: str) -> dict[str, bytes] | None:
        """The fields of `key`, or None when absent; drops every expired key first."""
        now = self._clock()
        while self._keys:
            oldest, (_, expires) = next(iter(self._keys.items()))
            if expires > now:
                break
            del self._keys[oldest]
        entry = self._keys.get(key)
        return entry[0] if entry is not None else None

    def _put(self, key: str, fields: dict[str, bytes]) -> None:
        """Stores `fields` (none: deletes the key) with a fresh TTL, then evicts past `max_keys`."""
        self._keys.pop(key, None)
        if not fields:
            return
        self._keys[key] = (fields, self._clock() + self._ttl)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)

    async def read(self, key: str) -> dict[str, bytes]:
        return dict(self._live(key) or {})

    async def write(self, key: str, fields: Mapping[str, bytes], *, owner: str | None = None) -> bool:
        current = self._live(key)
        if owner is not None and (current is None or current.get(OWNER) != owner.encode()):
            return False
        self._put(key, {**(current or {}), **fields})
        return True

    async def advance(
        self, key: str, field: str, position: int, fields: Mapping[str, bytes], *, owner: str,
        always: Mapping[str, bytes] | None = None,
    ) -> bool:
        current = self._live(key)
        if current is None or current.get(OWNER) != owner.encode():
            return False
        current = {**current, **(always or {})}
        if int(current.get(field, b"0")) < position:
            self._put(key, {**current, **fields, field: b"%d" % position})
        else:
            self._put(key, current)  # `always` and the TTL only
        return True

    async def amend(self, key: str, fields: Mapping[str, bytes]) -> bool:
        current = self._live(key)
        if current is None:
            return False
        self._put(key, {**current, **fields})
        return True

    async def claim(self, key: str, field: str, value: bytes) -> bool:
        current = self._live(key) or {}
        if field in current:
            return False
        self._put(key, {**current, field: value})
        return True

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        before = self._live(key) or {}
        self._put(key, {**before, OWNER: owner.encode()})
        return dict(before)

    async def forget(self, key: str) -> None:
        self._keys.pop(key, None)

    async def aclose(self) -> None:
        self._keys.clear()

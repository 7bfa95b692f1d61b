"""Rate limits and budgets: the Limiter protocol and its in-memory implementation.

Every limit is a *sliding window log* over `window_s`: a scope (a key, a tenant, a client address, or
everything) admits a request only if fewer than `rpm` requests and at most `tpm - tokens` tokens were
recorded in the last window. The tokens a request records at admission are a reservation: all it may
use (its prompt's estimate and its `max_tokens`, as Azure OpenAI counts them). When it ends, the charge
replaces the reservation by what it used, at the time of the charge, so the unused part is free again
and the window never holds more than `tpm` (unless a prompt used more than its estimate). A log is
exact (no burst at a window edge, unlike fixed windows or a token bucket with a burst), and a refusal
knows exactly when the oldest entry that blocks it leaves the window, which is the retry-after.
Budgets are a running spend per scope with no window, kept only for a scope that has a budget:
`llm.usage` records every charge for billing, and a spend kept for every scope left a key with no TTL
in Redis per JWT subject ever seen.

Admission across scopes is all or nothing: each scope is checked and recorded atomically on its own
(one Lua script per scope in Redis, so scopes may live on different Redis Cluster slots), and if a
later scope refuses, the scopes already recorded are released. A request id recorded once is admitted
again without counting twice, so a redelivered request is not charged twice. The ticket (what the charge
needs at the end) belongs to the call that recorded the id in the first scope, and is never replaced: a
call that found the id recorded (a redelivery, or another request under an id in use, which ingest
refuses) keeps none and undoes nothing of the first's. A second request under a running one's id
replaced its ticket (a shorter TTL: charged nothing) or, refused, deleted it and its window entries.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from topics.stream import LimitScope

Resource = Literal["requests", "tokens", "budget"]
_SAFE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_HASHED = re.compile(r"^h[0-9a-f]{24}$")  # what `tag` makes of an unsafe name: a name of that form is hashed too


@dataclass(frozen=True)
class Scope:
    kind: LimitScope
    name: str
    rpm: int = 0  # 0: no limit
    tpm: int = 0
    budget: float = 0.0
    billed: bool = False  # spend accumulates here: a key or a tenant with a budget (the gateway decides)

    @property
    def tag(self) -> str:
        """`kind:name`, safe inside a Redis hash tag (names with other characters are hashed)."""
        # A safe name that looks like a hashed one ("h" + 24 hex digits) is hashed as well: else a tenant
        # named after another's hash shared its windows, spend and budget.
        safe = _SAFE.match(self.name) and not _HASHED.match(self.name)
        name = self.name if safe else "h" + hashlib.sha256(self.name.encode()).hexdigest()[:24]
        return f"{self.kind}:{name}"

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.budget)


@dataclass(frozen=True)
class Refusal:
    scope: Scope
    resource: Resource
    limit: float
    remaining: int
    retry_after_s: float | None  # None: it will never fit (a budget spent, more tokens than the limit)


class Limiter(Protocol):
    """Shared limit state. Implementations: `MemoryLimiter` and `redis_limits.RedisLimiter`; both raise
    `StoreUnavailable` (errors.py) only when their store cannot be reached."""

    async def admit(self, scopes: Sequence[Scope], member: str, tokens: int, ticket: bytes, ticket_ttl_s: float) -> Refusal | None:
        """Records request `member` with `tokens` reserved in every scope, and keeps `ticket` for
        `take_ticket` (unless `member` was recorded in the first scope already, or a ticket is kept for
        it: never replaced), if every scope has room; otherwise records nothing and says which limit
        refused (`retry_after_s` None for `tokens` over a limit: such a request can never fit). A scope
        that had `member` recorded already admits it and keeps its entry as it is."""

    async def charge(self, scopes: Sequence[Scope], member: str, reserved: int, tokens: int, spend: float) -> None:
        """Replaces the `reserved` tokens `admit` recorded by the `tokens` the request used, in every scope
        (a reservation that already left the window, the request having run longer than it, is not
        replaced: it counted in full), and adds spend to the billed ones; never refuses; once per member."""

    async def take_ticket(self, member: str) -> bytes | None:
        """The ticket `admit` kept for `member`, removed so a second call returns None."""

    async def spent(self, scope: Scope) -> float: ...


@dataclass
class _Log:
    """One scope's window. Entries are inserted in time order, so the oldest is first in each dict."""

    requests: dict[str, float] = field(default_factory=dict)  # member -> time
    tokens: dict[str, tuple[float, int]] = field(default_factory=dict)  # member -> (time, tokens)
    total: int = 0  # the tokens in `tokens`
    spend: float = 0.0

    def expire(self, cutoff: float) -> None:
        while self.requests and (oldest := next(iter(self.requests))) and self.requests[oldest] <= cutoff:
            del self.requests[oldest]
        while self.tokens and (oldest := next(iter(self.tokens))) and self.tokens[oldest][0] <= cutoff:
            self.total -= self.tokens.pop(oldest)[1]

    def add_tokens(self, entry: str, at: float, tokens: int) -> None:
        self.tokens[entry] = (at, tokens)
        self.total += tokens

    def charge(self, member: str, at: float, tokens: int) -> bool:
        """As charge.lua: the reservation, if still in the window, replaced by `tokens` at `at` (the newest
        time, so the entries stay in time order); else a mark of weight 0. False if charged already."""
        if member + "|c" in self.tokens:
            return False
        reserved = self.tokens.pop(member + "|p", None)
        if reserved is not None:
            self.total -= reserved[1]
        self.add_tokens(member + "|c", at, tokens if reserved is not None else 0)
        return True

    def used(self) -> int:
        return self.total


class MemoryLimiter:
    """The same semantics as the Redis limiter, for one process (tests, and a Redis-less demo)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.time) -> None:
        self._window = window_s
        self._clock = clock
        self._logs: dict[str, _Log] = {}
        self._tickets: dict[str, tuple[bytes, float]] = {}

    async def admit(self, scopes: Sequence[Scope], member: str, tokens: int, ticket: bytes, ticket_ttl_s: float) -> Refusal | None:
        now = self._clock()
        for scope in scopes:
            refusal = self._check(scope, member, tokens, now)
            if refusal is not None:
                return refusal
        added = []
        for scope in scopes:
            log = self._logs.setdefault(scope.tag, _Log())
            added.append(member not in log.requests)
            if added[-1]:
                log.requests[member] = now
                if tokens:
                    log.add_tokens(member + "|p", now, tokens)
        kept = self._tickets.get(member)
        if (added[0] if added else True) and (kept is None or kept[1] <= now):  # as ticket.lua: never replaced
            self._tickets[member] = (ticket, now + ticket_ttl_s)
        return None

    def _check(self, scope: Scope, member: str, tokens: int, now: float) -> Refusal | None:
        log = self._logs.setdefault(scope.tag, _Log())
        log.expire(now - self._window)
        if member in log.requests:
            return None
        if scope.budget and log.spend >= scope.budget:
            return Refusal(scope, "budget", scope.budget, 0, None)
        if scope.rpm and len(log.requests) >= scope.rpm:
            times = list(log.requests.values())
            return Refusal(scope, "requests", scope.rpm, 0, times[len(times) - scope.rpm] + self._window - now)
        used = log.used()
        if scope.tpm and used + tokens > scope.tpm:
            if tokens > scope.tpm:
                return Refusal(scope, "tokens", scope.tpm, max(scope.tpm - used, 0), None)
            need, retry = used + tokens - scope.tpm, self._window
            for at, n in log.tokens.values():
                need -= n
                if need <= 0:
                    retry = at + self._window - now
                    break
            return Refusal(scope, "tokens", scope.tpm, max(scope.tpm - used, 0), retry)
        return None

    async def charge(self, scopes: Sequence[Scope], member: str, reserved: int, tokens: int, spend: float) -> None:
        now = self._clock()
        for scope in scopes:
            log = self._logs.setdefault(scope.tag, _Log())
            log.expire(now - self._window)
            if log.charge(member, now, max(tokens, 0)):
                log.spend += spend if scope.billed else 0.0

    async def take_ticket(self, member: str) -> bytes | None:
        ticket, until = self._tickets.pop(member, (None, 0.0))
        return ticket if ticket is not None and until > self._clock() else None

    async def spent(self, scope: Scope) -> float:
        log = self._logs.get(scope.tag)
        return log.spend if log else 0.0

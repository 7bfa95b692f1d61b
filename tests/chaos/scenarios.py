"""The fault plans: what each profile sends and what it breaks, and when.

A profile is a list of scenarios run one after the other on the same services and workers. The first
is fault-free: its texts are the reference every later scenario is compared with. A request is made
from a `RequestSpec` (its length and deadline); request j of a scenario uses spec j of its family
(cycling), with a prompt of its own, so the texts to compare are those of the same spec.

    short   ~60 requests per scenario, 40 ms per token; SIGKILL of every stage once (decode twice),
            SIGSTOP of a decode worker past the session timeout, a Redis restart (<= ~3 minutes)
    output-guard  the short profile's shape with postguard between decode and emit (the default profile's
            output guard, with its held-back window in Redis): SIGKILL of postguard twice and of every
            other stage once, SIGSTOP of postguard past the session timeout, a Redis restart, a broker restart
    input-guard   the same shape with the input guard between ingest and route (PII and injection screening,
            its verdict memo in Redis): SIGKILL of guard twice and of every other stage once, SIGSTOP of
            guard past the session timeout, a Redis restart
    full    >= 50 SIGKILLs over every stage (one every 4 s), SIGSTOP of decode and of emit, a broker restart, a 60 s
            broker outage under long streams, a Redis restart, Redis and the broker each hung (SIGSTOP) 20 s,
            a decode worker added then removed
    full-guarded  the full profile's plan with both guards in the path (the default `make run` profile's
            stages, one worker per guard), in `make chaos`
    processes  two processes that each run every stage (`sluice worker`, as `sluice run` does), so the
            stages of a process hand their messages over in memory (cache and route from ingest, generate
            from route, emit from generate and from the cache: the instant backend without the
            prefill/decode split; every fourth request repeats an earlier one, a cache hit); whole
            processes SIGKILLed, one SIGSTOPped past the session timeout with a Redis restart, a broker restart
    processes-guarded  the same with both guards in each process (the default `make run` graph: guard,
            cache, postguard), in `make chaos`
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

FaultKind = Literal["kill", "pause", "broker_restart", "broker_outage", "broker_hang", "redis_restart", "redis_hang", "add", "remove"]
BARE = ("ingest", "route", "prefill", "decode", "emit")  # the profile without guards
CACHED = ("ingest", "cache", "route", "prefill", "decode", "emit")  # the same with the cache (exact tier)
OUTPUT_GUARDED = ("ingest", "route", "prefill", "decode", "postguard", "emit")
INPUT_GUARDED = ("ingest", "guard", "route", "prefill", "decode", "emit")
GUARDED = ("ingest", "guard", "route", "prefill", "decode", "postguard", "emit")  # both guards, as `make run` has
GUARDED_CACHED = ("ingest", "guard", "cache", "route", "prefill", "decode", "postguard", "emit")  # `make run`'s graph
WHOLE = "all"  # the worker of a profile whose processes each run every stage (`Profile.whole`)
PAUSE_S = 8.0  # SIGSTOP this long: past the consumer session timeout (3 s)
OUTAGE_S = 60.0
HANG_S = 20.0  # a service SIGSTOPped this long: past every client's one-call timeout but Kafka's 30 s requests


@dataclass(frozen=True)
class RequestSpec:
    key: str  # "n07": the 8th normal spec; "L2": the 3rd long one
    max_tokens: int
    deadline_s: float


@dataclass(frozen=True)
class Fault:
    at_s: float  # after the scenario's first request
    kind: FaultKind
    stage: str | None = None  # kill, pause, add, remove
    seconds: float = 0.0  # pause, broker_hang, redis_hang: how long stopped; broker_outage: how long down


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: int
    faults: tuple[Fault, ...] = ()
    family: Literal["normal", "long", "all", "long-first"] = "normal"  # long-first: all, the long ones first
    rate: float = 4.0  # new requests per second


@dataclass(frozen=True)
class Profile:
    name: str
    token_delay_ms: float
    normal: tuple[RequestSpec, ...]
    long: tuple[RequestSpec, ...]
    scenarios: tuple[Scenario, ...]  # the first is the fault-free reference
    workers_per_stage: int = 2
    stages: tuple[str, ...] = BARE  # the profile row the workers run
    whole: bool = False  # each worker runs every stage in one process (faults name `WHOLE`), as `sluice run`
    split: bool = True  # the instant backend splits prefill from decode; False: one generate stage per request
    # From request `repeat_after` on, every fourth one asks what the request `repeat_after` before it asked
    # (its prompt and spec): with the cache in the profile, answered from the cache once that one is stored.
    repeat_after: int = 0

    def family(self, name: str) -> tuple[RequestSpec, ...]:
        return {"normal": self.normal, "long": self.long, "all": self.normal + self.long, "long-first": self.long + self.normal}[name]


def _normal(count: int, low: int, high: int, deadline_s: float) -> tuple[RequestSpec, ...]:
    span = high - low + 1
    return tuple(RequestSpec(f"n{i:02d}", low + (i * 7) % span, deadline_s) for i in range(count))


def _long(count: int, tokens: int, deadline_s: float) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(f"L{i}", tokens + i, deadline_s) for i in range(count))


def _short_shaped(
    name: str, kills: tuple[str, ...], kill_name: str, paused: str, stages: tuple[str, ...], broker: bool = False
) -> Profile:
    """60 requests per scenario at 40 ms a token: a kill of each of `kills`, 2.2 s apart; then `paused`
    stopped past its session, with a Redis restart; with `broker`, then a broker restart."""
    scenarios = (
        Scenario("reference", 60),
        Scenario(kill_name, 60, tuple(Fault(1.5 + 2.2 * i, "kill", stage) for i, stage in enumerate(kills))),
        Scenario(f"pause-{paused}+redis", 60, (Fault(2.0, "pause", paused, PAUSE_S), Fault(7.0, "redis_restart"))),
    )
    if broker:
        scenarios += (Scenario("broker-restart", 60, (Fault(4.0, "broker_restart"),)),)
    return Profile(
        name=name, token_delay_ms=40, normal=_normal(60, 30, 45, deadline_s=60), long=(), scenarios=scenarios,
        stages=stages,
    )


def _short() -> Profile:
    return _short_shaped("short", ("ingest", "decode", "route", "prefill", "emit", "decode"), "kill-each-stage", "decode", BARE)


def _output_guard() -> Profile:
    kills = ("postguard", "decode", "ingest", "postguard", "emit", "route")
    return _short_shaped(
        "output-guard", kills, "kill-postguard-and-each-stage", "postguard", OUTPUT_GUARDED, broker=True
    )


def _input_guard() -> Profile:
    kills = ("guard", "decode", "ingest", "guard", "emit", "route")
    return _short_shaped("input-guard", kills, "kill-guard-and-each-stage", "guard", INPUT_GUARDED)


def _full() -> Profile:
    # 56 kills, one every 4 s (past the 3 s session timeout and the rebalance after it, so each stall is
    # one takeover's, not several faults' stacked), decode twice as often as the others.
    order = ("decode", "emit", "prefill", "decode", "route", "ingest", "decode")
    kills = tuple(Fault(2.0 + 4.0 * i, "kill", order[i % len(order)]) for i in range(56))
    return Profile(
        name="full",
        token_delay_ms=40,
        normal=_normal(100, 40, 80, deadline_s=120),
        long=_long(16, 300, deadline_s=240),  # 12 s streams, so they are mid-flight when the broker goes
        scenarios=(
            Scenario("reference", 116, family="all"),
            Scenario("kills", 900, kills),
            Scenario("pause-decode-and-emit", 80, (Fault(3.0, "pause", "decode", PAUSE_S), Fault(11.0, "pause", "emit", PAUSE_S))),
            Scenario("scale-decode", 80, (Fault(3.0, "add", "decode"), Fault(12.0, "remove", "decode"))),
            Scenario("redis-restart", 60, (Fault(5.0, "redis_restart"),)),
            Scenario("broker-restart", 60, (Fault(5.0, "broker_restart"),)),
            # A hung service (SIGSTOP: connections open, no answers) is found only by timeouts.
            Scenario("redis-hang", 60, (Fault(5.0, "redis_hang", seconds=HANG_S),)),
            Scenario("broker-hang", 60, (Fault(5.0, "broker_hang", seconds=HANG_S),)),
            # Last: if the pipeline does not recover from it, every scenario before it still has its report.
            # The long streams are mid-flight when the broker goes; the normal requests after them are sent
            # while it is away (the SDK's batches expire after 30 s and it sends them again).
            Scenario("broker-outage", 116, (Fault(5.0, "broker_outage", seconds=OUTAGE_S),), family="long-first"),
        ),
    )


def _processes() -> Profile:
    """Whole processes faulted: a kill takes every stage of one of the two down at once (and whatever
    its stages had handed over in memory), 6 s apart so the survivor serves alone meanwhile."""
    kills = tuple(Fault(2.0 + 6.0 * i, "kill", WHOLE) for i in range(5))
    scenarios = (
        Scenario("reference", 60),
        Scenario("kill-processes", 120, kills),
        Scenario("pause-process+redis", 60, (Fault(2.0, "pause", WHOLE, PAUSE_S), Fault(7.0, "redis_restart"))),
        Scenario("broker-restart", 60, (Fault(4.0, "broker_restart"),)),
    )
    return Profile(
        name="processes", token_delay_ms=40, normal=_normal(60, 30, 45, deadline_s=60), long=(), scenarios=scenarios,
        stages=CACHED, whole=True, split=False, repeat_after=16,  # 4 s later: its stream (<= 1.8 s) has ended
    )


PROFILES: dict[str, Profile] = {
    "short": _short(), "output-guard": _output_guard(), "input-guard": _input_guard(), "full": _full(),
    "full-guarded": replace(_full(), name="full-guarded", stages=GUARDED), "processes": _processes(),
    "processes-guarded": replace(_processes(), name="processes-guarded", stages=GUARDED_CACHED),
}

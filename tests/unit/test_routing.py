"""Routing: rules, health and ejection, power of two choices, prefix affinity within a share of traffic, and a
request moved on to its fallback when its backend fails before the first chunk."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter

import pytest

from pipeline.backends.errors import ModelError
from pipeline.errors import StageError
from pipeline.gateway.config import ModelPrice
from pipeline.routing.affinity import PrefixAffinity
from pipeline.routing.choose import choose
from pipeline.routing.config import RouteRule, RoutingSettings
from pipeline.routing.health import UNKNOWN, HealthView, Member
from pipeline.routing.stats import BackendStats
from pipeline.settings import BackendSettings, Settings
from pipeline.stages.generate import GenerateStage
from pipeline.stages.route import RouteStage
from pipeline.state import MemoryStateStore
from pipeline.topology import graph
from tests.unit.fakes import run_handler
from tests.unit.helpers import admitted, request
from topics import registry
from topics.health import BackendHealth
from topics.hops import Route, Routed, forward
from topics.requests import ChatMessage, Priority

pytestmark = pytest.mark.asyncio
ROUTING = RoutingSettings()
NAMES = ["a", "b", "c"]


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def members(**loads: float) -> dict[str, Member]:
    return {n: Member(load=loads.get(n, 0.0), ejected=False, ttft_p95_ms=0.0, known=True) for n in NAMES}


async def test_power_of_two_choices_never_picks_the_most_loaded_of_three() -> None:
    rng = random.Random(1)
    picks = Counter(choose(NAMES, members(a=0.9, b=0.1, c=0.5), "", ROUTING, rng=rng)[0] for _ in range(300))
    assert picks["a"] == 0 and picks["b"] > picks["c"] > 0


async def test_ejected_backends_are_only_a_last_resort() -> None:
    view = members()
    view["b"] = dataclasses.replace(view["b"], ejected=True)
    assert all(choose(NAMES, view, "", ROUTING)[0] != "b" for _ in range(50))
    assert choose(NAMES, view, "", ROUTING)[-1] == "b"  # listed last, not dropped (session 47: it was dropped)
    all_out = {n: dataclasses.replace(m, ejected=True) for n, m in view.items()}
    assert sorted(choose(NAMES, all_out, "", ROUTING)) == NAMES  # panic: better tried than refused


async def test_a_backend_that_went_silent_draws_no_traffic_while_others_are_up() -> None:
    view = HealthView(ROUTING)
    now = time.time()
    for name, in_flight in (("a", 3), ("b", 3)):
        view.apply(BackendHealth(name, f"p{name}", "w1", now, in_flight, 4, 0, 0, 0.0, 0.0, 0.0))
    view.apply(BackendHealth("c", "pc", "w1", now - 60, 0, 4, 0, 0, 0.0, 0.0, 0.0))  # its last word: idle, a minute ago
    current = {n: view.member(n, now) for n in NAMES}
    assert current["c"].silent and not current["a"].silent
    assert all(choose(NAMES, current, "", ROUTING)[-1] == "c" for _ in range(50))  # a last resort, not dropped
    never = {**current, "c": view.member("never-reported", now)}  # unknown (a new backend): still tried
    assert any(choose(NAMES, never, "", ROUTING)[0] == "c" for _ in range(50))
    gone = {n: dataclasses.replace(m, silent=True) for n, m in current.items()}
    assert sorted(choose(NAMES, gone, "", ROUTING)) == NAMES  # all silent: better tried than refused


async def test_only_an_answer_ends_a_failure_streak() -> None:
    stats = BackendStats("a", "pa", "w1", capacity=4, eject_after=5)
    stage = GenerateStage(None, graph(("ingest", "route", "generate", "emit"), ("pa",), frozenset({"pa"}))[2].topics,  # type: ignore[arg-type]
                          MemoryStateStore(), stats=stats)
    message = forward(admitted(request("s1")), Routed, route=Route(backend="a", pool="pa"))
    for failure, answered in ((ModelError("5xx"), False), (None, False), (ModelError("5xx"), False)):
        stats.started()
        stage._counting.add(message.id)
        stage._ended(message, failure, sent=0, answered=answered)  # the middle one: a client gave up
    assert stats.streak == 2 and stats.in_flight == 0
    stats.started()
    stage._ended(message, None, sent=3, answered=True)
    assert stats.streak == 0


async def test_a_latency_objective_prefers_backends_that_meet_it() -> None:
    view = members()
    view["a"] = dataclasses.replace(view["a"], ttft_p95_ms=900.0)
    assert all(choose(NAMES, view, "", ROUTING, ttft_objective_ms=500)[0] != "a" for _ in range(50))


async def test_prefix_affinity_keeps_each_prefix_on_the_backend_it_was_placed_on() -> None:
    affinity = PrefixAffinity(ROUTING)
    prefixes = [f"You are support agent number {k} for ACME. " * 40 for k in range(6)]
    placed: dict[int, set[str]] = {k: set() for k in range(6)}
    for i in range(120):
        k = i % 6
        placed[k].add(choose(NAMES, members(), prefixes[k] + f"question {i}", ROUTING, affinity=affinity)[0])
    assert all(len(backends) == 1 for backends in placed.values())  # the first 1,000 characters decide
    assert Counter(next(iter(b)) for b in placed.values()) == {"a": 2, "b": 2, "c": 2}  # new prefixes spread
    short = {choose(NAMES, members(), f"hi {i}", ROUTING, rng=random.Random(i), affinity=affinity)[0] for i in range(30)}
    assert len(short) > 1  # short prompts are spread by load


async def test_a_prefix_spreads_to_another_backend_when_its_own_is_busy_or_takes_more_than_its_share() -> None:
    affinity = PrefixAffinity(ROUTING)
    prefix = "You are a support agent for ACME. " * 40
    view = {n: Member(load=0.0, ejected=False, ttft_p95_ms=0.0, known=True, unit=1 / 16) for n in NAMES}
    owner = choose(NAMES, view, prefix, ROUTING, affinity=affinity)[0]
    busy = {**view, owner: dataclasses.replace(view[owner], load=5 / 16)}  # 5 running, 0 elsewhere: over mean + 3
    second = choose(NAMES, busy, prefix, ROUTING, affinity=affinity)[0]
    assert second != owner
    assert {choose(NAMES, view, prefix, ROUTING, affinity=affinity)[0] for _ in range(4)} == {owner, second}
    hot = [choose(NAMES, view, prefix + str(i), ROUTING, affinity=affinity)[0] for i in range(300)]
    assert max(Counter(hot).values()) / 100 <= 1.3  # one hot prefix alone spreads within the bound
    cold = "You are a tax advisor. " * 60
    placed = {choose(NAMES, view, cold + str(i), ROUTING, affinity=affinity)[0] for i in range(0, 300, 50)}
    assert len(placed) == 1  # a prefix that is not more than one backend's share stays on one


async def test_a_failure_streak_ejects_for_a_growing_term_and_a_success_after_it_resets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A success used to end an ejection at once and reset its growing term, even one of a request that
    started before the ejection (session 47): now it ends nothing while the term runs; after it, it resets."""
    clock = FakeClock(1_000_000.0)
    monkeypatch.setattr("pipeline.routing.stats.time", clock)
    stats = BackendStats("a", "pa", "w1", capacity=4, eject_after=5)
    view = HealthView(ROUTING)
    published = [stats.finished(failed=True) for _ in range(5)]
    assert published == [False, False, False, False, True]  # the 5th failure is reported at once
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now).ejected and not view.member("a", clock.now + 31).ejected
    for _ in range(5):
        stats.finished(failed=True)
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now + 31).ejected  # the second ejection lasts 60 s
    stats.finished(failed=False)  # during the term: ends nothing
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now + 59).ejected and stats.ejections == 2
    clock.now += 61
    stats.finished(failed=False)  # after the term: the streak and the growth are over
    assert (stats.streak, stats.ejections) == (0, 0)
    for _ in range(5):
        stats.finished(failed=True)
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now + 29).ejected and not view.member("a", clock.now + 31).ejected  # 30 s again
    assert view.member("zzz", clock.now) == UNKNOWN


async def test_load_is_summed_over_a_backends_fresh_reports() -> None:
    view = HealthView(ROUTING)
    now = time.time()
    view.apply(BackendHealth("a", "pa", "w1", now, 3, 4, 0, 0, 0.0, 120.0, 0.0))
    view.apply(BackendHealth("a", "pa", "w2", now, 1, 4, 0, 0, 0.0, 80.0, 0.0))
    view.apply(BackendHealth("a", "pa", "w3", now - 60, 4, 4, 0, 0, 0.0, 0.0, 0.0))  # stale: ignored
    member = view.member("a", now)
    assert member.load == 0.5 and member.ttft_p95_ms == 120.0 and member.known


def settings_with(*rules: RouteRule) -> Settings:
    backends = tuple(BackendSettings(name=n, model="m", pool=f"p{n}", kind="openai", base_url="http://127.0.0.1:1/v1") for n in NAMES)
    prices = {"m": ModelPrice(0.1, 0.2)}
    base = Settings()
    return dataclasses.replace(base, backends=backends, routing=RoutingSettings(rules=rules),
                               gateway=dataclasses.replace(base.gateway, prices=prices))


def route_stage(settings: Settings) -> RouteStage:
    node = next(n for n in graph(("ingest", "route", "prefill", "decode", "emit"), settings.pools, settings.unsplit_pools) if n.kind == "route")
    return RouteStage(settings, node.topics, rng=random.Random(3))


async def test_rules_match_task_language_tenant_lane_and_length() -> None:
    rules = (
        RouteRule(name="code", backends=("c",), tasks=("code",)),
        RouteRule(name="french", backends=("b",), languages=("fr",)),
        RouteRule(name="acme-batch", backends=("a",), tenants=("acme",), priority="batch"),
        RouteRule(name="long", backends=("a", "b"), min_prompt_chars=500),
    )
    stage = route_stage(settings_with(*rules))
    ask = lambda text, **kw: admitted(request("r1", model="m", messages=(ChatMessage(role="user", content=text),), **kw), "t")  # noqa: E731
    assert stage.choose(ask("write a sort", task="code")).backend == "c"
    assert stage.choose(ask("Bonjour, pouvez-vous m'aider à écrire une lettre de motivation ?")).backend == "b"
    french_then_note = admitted(request("r3", model="m", messages=(
        ChatMessage(role="user", content="Bonjour, pouvez-vous m'aider à écrire une lettre de motivation ?"),
        ChatMessage(role="system", content="Answer briefly and politely, in the user's own language."))), "t")
    assert stage.choose(french_then_note).backend == "b"  # the user's turn is read, not a system note after it
    acme = admitted(request("r2", model="m", priority=Priority.batch), "acme")
    assert stage.choose(acme).backend == "a"
    long_route = stage.choose(ask("tell me " * 100))
    assert {long_route.backend, *long_route.fallbacks} == {"a", "b"}
    plain = stage.choose(ask("hello there"))
    assert {plain.backend, *plain.fallbacks} == set(NAMES) and plain.pool == f"p{plain.backend}"


async def test_a_cost_ceiling_no_backend_meets_is_refused() -> None:
    stage = route_stage(settings_with(RouteRule(name="cheap", backends=("a", "b"), max_cost_per_1k=0.1)))
    with pytest.raises(StageError):
        stage.choose(admitted(request("r1", model="m")))


async def test_route_hears_health_and_avoids_an_ejected_backend() -> None:
    stage = route_stage(settings_with())
    stats = BackendStats("a", "pa", "w1", capacity=4)
    for _ in range(5):
        stats.finished(failed=True)
    await stage.on_table(stats.report())
    assert all(stage.choose(admitted(request(f"r{i}", model="m"))).backend != "a" for i in range(30))


class Failing:
    name = "a"

    async def generate(self, request):  # type: ignore[no-untyped-def]
        raise ModelError("upstream failed (HTTP 500)")
        yield  # pragma: no cover

    async def cancel(self, request_id: str) -> None:
        pass


async def test_a_backend_failing_before_the_first_chunk_hands_the_request_to_the_next() -> None:
    settings = settings_with()
    node = next(n for n in graph(("ingest", "route", "prefill", "decode", "emit"), settings.pools, settings.unsplit_pools) if n.name == "generate.pa")
    stats = BackendStats("a", "pa", "w1", capacity=4)
    stage = GenerateStage(Failing(), node.topics, MemoryStateStore(), stats=stats, backends={b.name: b for b in settings.backends})
    message = forward(admitted(request("r1")), Routed, route=Route(backend="a", pool="pa", fallbacks=("b", "c")))
    outs = await run_handler(stage, message)
    [onward] = [o for o in outs if o.topic != registry.HEALTH]
    assert onward.topic == registry.routed_topic("pb") and onward.value.route == Route(backend="b", pool="pb", fallbacks=("c",))
    last = forward(admitted(request("r2")), Routed, route=Route(backend="a", pool="pa"))
    ending = (await run_handler(stage, last))[-1].value
    assert ending.code.value == "backend_error"  # no fallback left: the terminal event
    for i in range(3):
        outs = await run_handler(stage, forward(admitted(request(f"r{i + 3}")), Routed, route=Route(backend="a", pool="pa")))
    assert [o.topic for o in outs][0] == registry.HEALTH  # the 5th failure in a row is published at once


async def test_a_health_record_cannot_claim_the_future_or_a_negative_load() -> None:
    view = HealthView(ROUTING)
    now = time.time()
    view.apply(BackendHealth("a", "pa", "forged", 1e15, -1_000_000, 4, 5, 1, 1e15, 0.0, 0.0), now=now)
    member = view.member("a", now)
    assert member.load == 0.0  # not -250,000: the forged record wins no choice
    assert not view.member("a", now + ROUTING.ejection_s + 1).ejected  # an ejection of the usual term, not forever
    view.apply(BackendHealth("a", "pa", "forged", now + 1, 0, 4, 0, 0, 0.0, 0.0, 0.0), now=now + 1)
    assert not view.member("a", now + 1).ejected  # its next report is not shut out by a timestamp from the future


async def test_the_health_view_forgets_workers_past_a_bound() -> None:
    from pipeline.routing.health import MAX_WORKERS

    view = HealthView(ROUTING)
    now = time.time()
    for n in range(MAX_WORKERS * 3):  # a restart (or a forged record) per name
        view.apply(BackendHealth("a", "pa", f"w{n}", now - 3600 + n, 0, 4, 0, 0, 0.0, 0.0, 0.0), now=now)
    assert len(view._reports["a"]) <= MAX_WORKERS


def two_model_settings(*rules: RouteRule, prices: dict[str, ModelPrice] | None = None) -> Settings:
    """`a` serves model "big"; `b` and `c` serve "m"."""
    backends = tuple(BackendSettings(name=n, model=m, pool=f"p{n}", kind="openai", base_url="http://127.0.0.1:1/v1")
                     for n, m in (("a", "big"), ("b", "m"), ("c", "m")))
    prices = {"m": ModelPrice(0.1, 0.2), "big": ModelPrice(1.0, 2.0)} if prices is None else prices
    base = Settings()
    return dataclasses.replace(base, backends=backends, routing=RoutingSettings(rules=rules),
                               gateway=dataclasses.replace(base.gateway, prices=prices))


async def test_a_rule_sends_a_request_only_to_its_backends_that_serve_the_requested_model() -> None:
    """A rule with no `models` matched every model and named its backends whatever they serve: a request for
    "m" with the client's `x-sluice-task: code` went to the backend of "big" (served, billed and cached as
    "m") (docs/reliability.md, session 47)."""
    stage = route_stage(two_model_settings(RouteRule(name="code", backends=("a", "b"), tasks=("code",))))
    for i in range(20):
        small = stage.choose(admitted(request(f"s{i}", model="m", task="code")))
        assert (small.backend, small.fallbacks) == ("b", ())  # the rule's backends of "m", in the rule's order
        big = stage.choose(admitted(request(f"b{i}", model="big", task="code")))
        assert (big.backend, big.fallbacks) == ("a", ())
    only_big = route_stage(two_model_settings(RouteRule(name="code", backends=("a",), tasks=("code",))))
    fallthrough = only_big.choose(admitted(request("r1", model="m", task="code")))
    assert {fallthrough.backend, *fallthrough.fallbacks} == {"b", "c"}  # no backend of "m": the model's own


async def test_a_latency_objective_orders_and_does_not_drop_candidates() -> None:
    """The objective, ejection and silence filtered: the first choice failing before its first token had no
    fallback (502) while healthy backends were left (docs/reliability.md, session 47)."""
    view = members()
    view["b"] = dataclasses.replace(view["b"], ttft_p95_ms=900.0)
    view["c"] = dataclasses.replace(view["c"], ttft_p95_ms=900.0)
    for _ in range(20):
        assert choose(NAMES, view, "", ROUTING, ttft_objective_ms=800)[0] == "a"
        assert sorted(choose(NAMES, view, "", ROUTING, ttft_objective_ms=800)) == NAMES
    view["b"] = dataclasses.replace(view["b"], ejected=True)
    view["c"] = dataclasses.replace(view["c"], silent=True)
    assert choose(NAMES, view, "", ROUTING, ttft_objective_ms=800) == ["a", "c", "b"]  # healthy, silent, ejected


async def test_power_of_two_choices_counts_what_it_sent_since_the_last_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load came only from the once-a-second reports, so for a whole second every request went to the backend
    that had looked lighter (docs/reliability.md, session 47)."""
    clock = FakeClock(1_000_000.0)
    monkeypatch.setattr("pipeline.stages.route.time", clock)
    stage = route_stage(settings_with())
    for name, in_flight in (("a", 1), ("b", 2), ("c", 2)):
        await stage.on_table(BackendHealth(name, f"p{name}", "w1", clock.now, in_flight, 16, 0, 0, 0.0, 0.0, 0.0))
    sent: Counter[str] = Counter()
    for i in range(60):  # 60 requests within one report interval
        clock.now += 0.01
        sent[stage.choose(admitted(request(f"r{i}", model="m"))).backend] += 1
    assert max(sent.values()) <= 24 and min(sent.values()) >= 16, sent  # about a third each, not a's 2/3
    for name in NAMES:  # a newer report counts what reached the backend: what route counted is dropped
        stage.health.apply(BackendHealth(name, f"p{name}", "w1", clock.now, 0, 16, 0, 0, 0.0, 0.0, 0.0), now=clock.now)
    assert all(stage.health.member(n, clock.now).load == 0.0 for n in NAMES)


async def test_a_backend_without_a_price_fails_a_cost_ceiling_closed() -> None:
    """A model with no price passed every cost ceiling (price read as 0) (docs/reliability.md, session 47)."""
    stage = route_stage(two_model_settings(RouteRule(name="cheap", backends=("b", "c"), max_cost_per_1k=5.0), prices={}))
    with pytest.raises(StageError):
        stage.choose(admitted(request("r1", model="m")))


async def test_a_success_during_an_ejection_term_does_not_end_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that started before the ejection and ended well un-ejected its backend at the next report
    and reset the growing term (docs/reliability.md, session 47)."""
    clock = FakeClock(1_000_000.0)
    monkeypatch.setattr("pipeline.routing.stats.time", clock)
    stats = BackendStats("a", "pa", "w1", capacity=4, eject_after=5)
    view = HealthView(ROUTING)
    for _ in range(6):
        stats.started()  # the 6th: a long stream, still running when the backend is ejected
    for _ in range(5):
        stats.finished(failed=True)
    clock.now += 10
    stats.finished(failed=False)  # the long stream ends well, 10 s into the 30 s term
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now).ejected and not view.member("a", clock.now + 21).ejected
    for _ in range(5):
        stats.finished(failed=True)  # still failing: the second ejection's term is 60 s
    view.apply(stats.report(), now=clock.now)
    assert view.member("a", clock.now + 59).ejected
    longer = BackendStats("a", "pa", "w2", capacity=4, eject_after=5, routing=RoutingSettings(ejection_s=60.0))
    for _ in range(5):
        longer.finished(failed=True)
    clock.now += 45
    longer.finished(failed=False)  # within the configured 60 s term
    assert longer.ejected(clock.now) and longer.ejections == 1

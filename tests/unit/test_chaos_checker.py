"""The chaos checker's verdict on usage records: one per finished request; a missing one is a violation
unless a kill of emit (or of a whole process) came while the request was in flight or just after it
ended, since emit's usage records linger in its producer (`kafka.lingering_ms`), or a Redis restart
overlapped it (a claim applied whose reply was lost)."""

from __future__ import annotations

from tests.chaos.checker import FaultEvent, Topics, check, numbered
from tests.chaos.clients import ClientResult
from tests.chaos.scenarios import WHOLE, RequestSpec

SPEC = RequestSpec("n00", 3, 60.0)


def finished(rid: str, sent_at: float, ended_at: float) -> ClientResult:
    """A request answered in one chunk with the instant backend's text (what the fault-free run checks)."""
    return ClientResult("s", SPEC, rid, sent_at, chunks=[(0, numbered(SPEC.max_tokens), sent_at)], outcome="done",
                        ended_at=ended_at, done_chunks=1)


def verdict(results: list[ClientResult], faults: list[FaultEvent], usage_for: list[str]) -> dict[str, int]:
    topics = Topics(usage=[{"kind": "usage.v2", "id": f"acme/{rid}"} for rid in usage_for])
    report = check("s", results, faults, topics, None, [], (0.0, 100.0, 0.0, 100.0))
    return {"missing": report.usage_missing, **{k: v for k, v in report.violations.items() if "usage" in k}}


def kill(stage: str, at: float) -> FaultEvent:
    return FaultEvent("kill", stage, 1, at, at + 0.1)


def test_a_missing_usage_record_is_a_violation_without_a_kill_of_emit() -> None:
    results = [finished("a", 1.0, 2.0), finished("b", 1.0, 2.0)]
    assert verdict(results, [], ["a", "b"]) == {"missing": 0}
    assert verdict(results, [kill("decode", 1.5)], ["a"]) == {"missing": 1, "usage record missing without a kill of emit or a Redis restart": 1}


def test_a_kill_of_emit_or_of_a_whole_process_around_the_end_excuses_it() -> None:
    results = [finished("a", 1.0, 2.0)]
    assert verdict(results, [kill("emit", 2.5)], []) == {"missing": 1}  # within the linger slack
    assert verdict(results, [kill(WHOLE, 1.5)], []) == {"missing": 1}
    assert verdict(results, [kill("emit", 5.0)], []) == {"missing": 1, "usage record missing without a kill of emit or a Redis restart": 1}
    assert verdict(results, [kill("emit", 0.5)], []) == {"missing": 1, "usage record missing without a kill of emit or a Redis restart": 1}


def test_a_redis_restart_overlapping_the_request_excuses_it() -> None:
    results = [finished("a", 1.0, 2.0)]
    assert verdict(results, [FaultEvent("redis_restart", None, None, 1.8, 2.6)], []) == {"missing": 1}
    assert verdict(results, [FaultEvent("redis_restart", None, None, 0.2, 0.9)], []) == {
        "missing": 1, "usage record missing without a kill of emit or a Redis restart": 1}
    assert verdict(results, [FaultEvent("redis_restart", None, None, 4.0, 4.5)], []) == {
        "missing": 1, "usage record missing without a kill of emit or a Redis restart": 1}


def test_a_second_usage_record_is_a_violation() -> None:
    assert verdict([finished("a", 1.0, 2.0)], [], ["a", "a"]) == {"missing": 0, "duplicate usage record": 1}

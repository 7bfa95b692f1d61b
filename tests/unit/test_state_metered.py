"""MeteredStore counts takeovers and fenced writes per stage, and passes every call through unchanged."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from pipeline.state import MemoryStateStore
from pipeline.state.metered import MeteredStore


def count(name: str, stage: str) -> float:
    return REGISTRY.get_sample_value(name, {"stage": stage}) or 0.0


@pytest.mark.asyncio
async def test_a_take_from_another_worker_is_a_takeover_and_its_old_owner_is_fenced() -> None:
    shared = MemoryStateStore()
    one, two = MeteredStore(shared, "emit-test-a"), MeteredStore(shared, "emit-test-a")
    taken, fenced = "sluice_state_takeovers_total", "sluice_state_fenced_writes_total"
    before_taken, before_fenced = count(taken, "emit-test-a"), count(fenced, "emit-test-a")

    assert await one.take("r1", "w1") == {}  # a new key: nobody to take it from
    assert await one.write("r1", {"emitted": b"3"}, owner="w1")
    assert (await one.take("r1", "w1"))["emitted"] == b"3"  # a rebuild of its own request
    assert count(taken, "emit-test-a") == before_taken

    assert (await two.take("r1", "w2"))["owner"] == b"w1"  # w2 takes it over
    assert count(taken, "emit-test-a") == before_taken + 1
    assert not await one.write("r1", {"emitted": b"4"}, owner="w1")  # w1 is fenced
    assert count(fenced, "emit-test-a") == before_fenced + 1
    assert await one.read("r1") == {"emitted": b"3", "owner": b"w2"}


@pytest.mark.asyncio
async def test_calls_pass_through() -> None:
    store = MeteredStore(MemoryStateStore(), "decode-test-b")
    assert await store.claim("r", "usage", b"1")
    assert not await store.claim("r", "usage", b"2")
    assert await store.write("r", {"a": b"1"})  # no owner: never fenced
    await store.forget("r")
    assert await store.read("r") == {}
    assert count("sluice_state_fenced_writes_total", "decode-test-b") == 0
    await store.aclose()

"""MemoryStateStore's expiry and bounds, on a fake clock (no services)."""

from __future__ import annotations

import pytest

from pipeline.state import MemoryStateStore
from tests.unit.fakes import Clock


@pytest.mark.asyncio
async def test_keys_expire_ttl_after_their_last_write() -> None:
    clock = Clock()
    store = MemoryStateStore(10.0, clock=clock)
    await store.write("k", {"a": b"1"})
    clock.now += 9.9
    assert await store.read("k") == {"a": b"1"}  # a read does not refresh the TTL
    await store.write("k", {"b": b"2"})
    clock.now += 9.9
    assert await store.read("k") == {"a": b"1", "b": b"2"}
    clock.now += 0.1
    assert await store.read("k") == {}
    assert await store.take("k", "w1") == {}  # an expired key's fields are gone for good
    assert await store.read("k") == {"owner": b"w1"}


@pytest.mark.asyncio
async def test_expired_keys_are_dropped_not_just_hidden() -> None:
    clock = Clock()
    store = MemoryStateStore(10.0, clock=clock)
    for i in range(5):
        await store.write(f"k{i}", {"a": b"1"})
    clock.now += 10.0
    await store.read("other")
    assert len(store) == 0


@pytest.mark.asyncio
async def test_take_and_a_successful_claim_refresh_the_ttl_a_failed_claim_does_not() -> None:
    clock = Clock()
    store = MemoryStateStore(10.0, clock=clock)
    await store.take("k", "w1")
    clock.now += 9.0
    assert await store.claim("k", "emitted", b"1") is True
    clock.now += 9.0
    assert await store.claim("k", "emitted", b"2") is False
    await store.take("k2", "w1")
    clock.now += 1.5
    assert await store.read("k") == {}
    assert await store.read("k2") == {"owner": b"w1"}


@pytest.mark.asyncio
async def test_the_key_written_longest_ago_is_evicted_first() -> None:
    clock = Clock()
    store = MemoryStateStore(100.0, max_keys=3, clock=clock)
    for name in ("a", "b", "c"):
        await store.write(name, {"v": name.encode()})
        clock.now += 1.0
    await store.write("a", {"v": b"a2"})  # "a" is now the newest
    await store.write("d", {"v": b"d"})
    assert len(store) == 3
    assert await store.read("b") == {}
    assert [await store.read(name) for name in ("a", "c", "d")] == [{"v": b"a2"}, {"v": b"c"}, {"v": b"d"}]
    await store.claim("e", "f", b"1")
    assert await store.read("c") == {}


@pytest.mark.asyncio
async def test_no_fields_create_no_key_and_returned_fields_are_copies() -> None:
    store = MemoryStateStore(10.0, clock=Clock())
    assert await store.write("k", {}) is True
    assert len(store) == 0
    await store.write("k", {"a": b"1"})
    (await store.read("k"))["a"] = b"changed"
    (await store.take("k", "w1"))["a"] = b"changed"
    assert await store.read("k") == {"a": b"1", "owner": b"w1"}


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        MemoryStateStore(0.0)
    with pytest.raises(ValueError):
        MemoryStateStore(10.0, max_keys=0)

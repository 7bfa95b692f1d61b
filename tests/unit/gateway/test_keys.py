import base64

import pytest

from pipeline.gateway.keys import (
    PREFIX,
    KeyEntry,
    KeyManager,
    KeyNotFound,
    MemoryKeyStore,
    confirmed,
    hash_key,
    new_key,
    well_formed,
)


def test_a_key_has_the_prefix_and_at_least_128_random_bits() -> None:
    keys = {new_key() for _ in range(1000)}
    assert len(keys) == 1000
    for key in keys:
        assert key.startswith(PREFIX)
        body = key[len(PREFIX) :]
        assert len(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))) * 8 >= 128
        assert well_formed(key)


@pytest.mark.parametrize(
    "candidate",
    ["' OR '1'='1", PREFIX, PREFIX + "short", PREFIX + "a" * 500, PREFIX + "abc'; DROP TABLE keys;--xxxxxxx",
     PREFIX + "abcdefghijklmnopqrstuvwxyz\x00", "Bearer " + new_key(), ""],
)
def test_malformed_keys_are_refused_before_lookup(candidate: str) -> None:
    assert not well_formed(candidate)


@pytest.mark.asyncio
async def test_the_store_holds_only_the_hash() -> None:
    store = MemoryKeyStore()
    raw, record = await KeyManager(store, rotate_overlap_s=10).create("acme", models=("m",), rpm=5)
    assert list(record.hashes) == [hash_key(raw)]
    assert raw not in repr(await store.all()) and raw[len(PREFIX):] not in repr(await store.all())
    entry = await store.lookup(hash_key(raw))
    assert entry is not None and entry.record.tenant == "acme" and entry.record.rpm == 5


@pytest.mark.asyncio
async def test_rotate_keeps_the_old_key_for_the_overlap_and_revoke_ends_both() -> None:
    store = MemoryKeyStore()
    manager = KeyManager(store, rotate_overlap_s=3600)
    old, record = await manager.create("acme")
    new, rotated = await manager.rotate(record.key_id)
    assert rotated.key_id == record.key_id and old != new
    old_entry, new_entry = await store.lookup(hash_key(old)), await store.lookup(hash_key(new))
    assert old_entry is not None and old_entry.not_after > 0 and new_entry is not None and new_entry.not_after == 0
    assert not old_entry.valid(old_entry.not_after + 1) and new_entry.valid(old_entry.not_after + 1)
    await manager.revoke(record.key_id)
    assert await store.lookup(hash_key(old)) is None and await store.lookup(hash_key(new)) is None
    [listed] = await manager.list()
    assert listed.revoked and listed.hashes == {}
    with pytest.raises(KeyNotFound):
        await manager.rotate(record.key_id)


@pytest.mark.asyncio
async def test_a_key_with_limits_that_are_not_numbers_or_a_tenant_that_is_not_a_name_is_refused() -> None:
    manager = KeyManager(MemoryKeyStore(), rotate_overlap_s=60.0)
    for kwargs in ({"budget": float("nan")}, {"budget": float("inf")}, {"budget": -1.0}, {"rpm": -5}):
        with pytest.raises(ValueError):  # NaN was written as null, and `sluice keys list` failed for every key
            await manager.create("acme", **kwargs)  # type: ignore[arg-type]
    for tenant in ("", "a/b", "bad\nname", "a b", "x" * 129):  # the tenant in `<tenant>/<id>` and CANCEL_ID
        with pytest.raises(ValueError):
            await manager.create(tenant)
    _, record = await manager.create("acme")
    await manager.create("x" * 128)
    with pytest.raises(ValueError):
        await manager.rotate(record.key_id, overlap_s=-2e9)


@pytest.mark.asyncio
async def test_a_hash_entry_is_good_only_until_the_record_says() -> None:
    """A rotation that lost its compare and set to `rotate --overlap-s 0` had written the old hash's entry
    good for a day: `confirmed` took the entry's expiry, and the leaked key worked on."""
    now = 1_000_000.0
    store = MemoryKeyStore(clock=lambda: now)
    manager = KeyManager(store, rotate_overlap_s=86400.0, clock=lambda: now)
    old, record = await manager.create("acme")
    await manager.rotate(record.key_id, overlap_s=0.0)
    stale_copy = KeyEntry(record, not_after=now + 86400.0)  # what the losing rotation wrote for the old hash
    entry = await confirmed(store, hash_key(old), stale_copy)
    assert entry is None or not entry.valid(now + 1.0)

"""The semantic index's bounds: expired entries are neither added nor kept, and memory is bounded across
tenants, since `llm.cache.entries` is replayed from its start (7 days) and tenant names can come from
JWT claims. What the topic says is checked: an entry outside its own tenant and model's scope is not
added, a purge counts from now at the latest, and purge marks do not pile up."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from pipeline.cache import index as semantic
from pipeline.cache.config import MAX_TTL_S, CacheSettings
from pipeline.cache.index import SemanticIndex, from_vector
from pipeline.cache.keys import scope
from pipeline.cache.traps import Salient
from pipeline.guard.embedder import DIMS
from topics.cache import Entry, Purge

NOW = 1_000_000.0
_rng = np.random.default_rng(11)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def unit() -> np.ndarray:
    vector = _rng.standard_normal(DIMS).astype(np.float32)
    return vector / np.linalg.norm(vector)


def entry(key: str, tenant: str = "acme", ttl_s: float = 60.0, vector: np.ndarray | None = None, answer: str = "Paris.") -> Entry:
    return Entry(key=scope(tenant, "m") + key, tenant=tenant, model="m", context="c", chunks=(answer,),
                 finish_reason="stop", prompt_tokens=5, completion_tokens=2, stored_at=NOW - 1, expires_at=NOW + ttl_s,
                 vector=from_vector(unit() if vector is None else vector), salient=msgspec.msgpack.encode(Salient()))


def search(index: SemanticIndex, tenant: str, vector: np.ndarray) -> Entry | None:
    found = index.search(tenant, "m", "c", vector, Salient(), 0.9)
    return None if found is None else found.entry


def test_an_entry_that_expired_before_it_was_read_is_not_indexed() -> None:
    """A restart replays 7 days of the topic: the expired entries in it loaded as well, and stayed."""
    index = SemanticIndex()  # the wall clock, which `expires_at` is on
    stale = entry("old")
    index.apply(msgspec.structs.replace(stale, expires_at=time.time() - 1.0))
    assert len(index) == 0
    index.apply(msgspec.structs.replace(entry("new"), stored_at=time.time(), expires_at=time.time() + 60.0))
    assert len(index) == 1


def test_expired_entries_go_although_no_lookup_meets_them() -> None:
    """Only a lookup that found an expired entry among its nearest candidates removed it: a tenant's
    index filled to `max_per_tenant` whatever the TTL."""
    clock = Clock()
    index = SemanticIndex(clock=clock)
    for i in range(2 * semantic.SWEEP + 3):
        index.apply(entry(f"a{i}", tenant="gone", ttl_s=10.0))
    clock.now += 11.0
    for i in range(3):  # each apply sweeps up to SWEEP expired entries
        index.apply(entry(f"b{i}", tenant="other"))
    assert len(index) == 3 and "gone" not in index._tenants  # the empty tenant's index went too
    assert index.nbytes == sum(semantic.footprint(e) for t in index._tenants.values() for e in t.entries.values())


def test_lookups_sweep_expired_entries_of_every_tenant() -> None:
    clock = Clock()
    index = SemanticIndex(clock=clock)
    kept = entry("kept", tenant="live", ttl_s=1000.0)
    index.apply(kept)
    for i in range(semantic.SWEEP):
        index.apply(entry(f"a{i}", tenant="idle", ttl_s=10.0))
    clock.now += 11.0
    assert search(index, "live", np.frombuffer(kept.vector, dtype=np.float16).astype(np.float32)) == kept
    assert len(index) == 1 and "idle" not in index._tenants


def test_an_expired_entry_never_answers() -> None:
    clock = Clock()
    index = SemanticIndex(clock=clock)
    vector = unit()
    index.apply(entry("k", ttl_s=10.0, vector=vector))
    assert search(index, "acme", vector) is not None
    clock.now += 10.0
    assert search(index, "acme", vector) is None and len(index) == 0


def test_the_oldest_entries_of_any_tenant_go_past_the_byte_bound() -> None:
    """No bound across tenants: every tenant could hold `max_per_tenant` entries of up to 64 KiB each."""
    sample = entry("x", answer="a" * 4000)
    index = SemanticIndex(max_bytes=3 * semantic.footprint(sample) + 100, clock=Clock())
    for i, tenant in enumerate(["t0", "t1", "t2", "t3", "t4"]):
        index.apply(entry(f"k{i}", tenant=tenant, answer="a" * 4000))
        assert index.nbytes <= 3 * semantic.footprint(sample) + 100
    assert sorted(index._tenants) == ["t2", "t3", "t4"] and len(index) == 3


def test_a_key_stored_again_and_a_purge_keep_the_count_and_bytes_right() -> None:
    index = SemanticIndex(clock=Clock())
    index.apply(entry("k", answer="first"))
    index.apply(entry("k", answer="second answer"))
    [[held]] = [list(t.entries.values()) for t in index._tenants.values()]
    assert held.chunks == ("second answer",) and len(index) == 1 and index.nbytes == semantic.footprint(held)
    index.apply(Purge("acme", None, NOW))
    assert len(index) == 0 and index.nbytes == 0 and not index._tenants


def test_the_byte_bound_is_a_setting() -> None:
    assert CacheSettings().max_index_bytes == 256 * 2**20
    assert any("max_index_bytes" in p for p in CacheSettings(max_index_bytes=0).problems())


@pytest.mark.parametrize("key", ["sluice:gateway:spend:acme", scope("other", "m") + "k", scope("acme", "n") + "k"])
def test_an_entry_whose_key_is_not_its_own_tenant_and_models_is_not_indexed(key: str) -> None:
    """Review found it (session 47): emit stored under whatever key a `Done`'s ticket named."""
    index = SemanticIndex(clock=Clock())
    index.apply(msgspec.structs.replace(entry("k"), key=key))
    assert len(index) == 0
    index.apply(entry("k"))
    assert len(index) == 1


def test_an_entry_that_would_outlive_the_longest_ttl_is_not_indexed() -> None:
    index = SemanticIndex(clock=Clock())
    index.apply(entry("k", ttl_s=MAX_TTL_S + 60.0))  # a purge mark dropped after MAX_TTL_S would not cover it
    assert len(index) == 0


def test_a_purge_dated_in_the_future_counts_from_now() -> None:
    """Review found it (session 47): `Purge.at` a year ahead refused every entry of the tenant until a restart."""
    clock = Clock()
    index = SemanticIndex(clock=clock)
    index.apply(entry("old"))
    index.apply(Purge("acme", None, NOW + 365 * 86400.0))
    assert len(index) == 0  # what was stored before it goes
    clock.now += 5.0
    index.apply(msgspec.structs.replace(entry("new"), stored_at=clock.now))
    assert len(index) == 1


def test_purge_marks_older_than_the_longest_ttl_are_dropped() -> None:
    """A mark per tenant and model purged, for ever: the table only grew (tenant names can come from JWT claims)."""
    clock = Clock()
    index = SemanticIndex(clock=clock)
    for i in range(5):
        index.apply(Purge(f"t{i}", None, NOW))
    assert len(index._purged) == 5
    clock.now += MAX_TTL_S + 1.0
    index.apply(Purge("later", "m", clock.now))
    index.apply(Purge("replayed", None, NOW))  # a record read again at a start, older than any entry alive
    assert list(index._purged) == [("later", "m")]

"""The KV store contract, one suite over the in-memory and the file implementation: round trip, the
byte bound (oldest evicted first), TTL, refused handles; and the file store's permissions."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.engine.kv_store import FileKVStore, KVStore, MemoryKVStore

H = [f"{i:032x}" for i in range(10)]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Make = Callable[..., KVStore]


@pytest.fixture(params=["memory", "file"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    def build(max_bytes: int = 1000, ttl_s: float = 60.0, clock: Callable[[], float] | None = None) -> KVStore:
        if request.param == "memory":
            return MemoryKVStore(max_bytes, ttl_s, clock or Clock(0.0))
        import time

        return FileKVStore(tmp_path / "kv", max_bytes, ttl_s, clock or time.time)

    return build


def test_round_trip_and_delete(make: Make) -> None:
    store = make()
    assert store.put(H[0], [b"abc"]) and store.get(H[0]) == b"abc"
    assert store.get(H[1]) is None
    store.delete(H[0])
    store.delete(H[0])  # deleting what is gone is fine
    assert store.get(H[0]) is None


def test_the_parts_are_kept_as_one_entry(make: Make) -> None:
    """What a handoff writes: a header, then each tensor's memory (any buffer, empty ones too)."""
    store = make()
    parts = [b"head", memoryview(bytearray(b"kk" * 50)), b"", memoryview(b"v" * 7)]
    assert store.put(H[0], parts)
    got = store.get(H[0])
    assert got is not None and bytes(got) == b"head" + b"kk" * 50 + b"v" * 7
    assert store.num_bytes == 111  # type: ignore[attr-defined]


def test_the_byte_bound_evicts_the_oldest_first(make: Make) -> None:
    store = make(max_bytes=1000)
    for i in range(5):
        assert store.put(H[i], [bytes([i]) * 300])
        assert store.num_bytes <= 1000  # type: ignore[attr-defined]
        _age_apart(store, H[i])
    assert [store.get(h) is not None for h in H[:5]] == [False, False, True, True, True]
    assert store.get(H[4]) == bytes([4]) * 300


def test_an_entry_larger_than_the_bound_is_refused(make: Make) -> None:
    store = make(max_bytes=100)
    assert not store.put(H[0], [b"x" * 101])
    assert store.get(H[0]) is None


def test_an_expired_entry_is_gone(make: Make) -> None:
    clock = Clock(1_000_000.0)
    store = make(ttl_s=10.0, clock=clock)
    store.put(H[0], [b"abc"])
    if isinstance(store, FileKVStore):
        clock.now = _mtime(store, H[0])
    assert store.get(H[0]) == b"abc"
    clock.now += 10.5
    assert store.get(H[0]) is None
    assert len(store) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["../etc/passwd", "ABCDEF0123456789", "short", "", "0" * 65, "0123456789abcdef/x"])
def test_handles_that_are_not_lower_case_hex_are_refused(make: Make, bad: str) -> None:
    store = make()
    for call in (lambda: store.put(bad, [b"x"]), lambda: store.get(bad), lambda: store.delete(bad)):
        with pytest.raises(ValueError):
            call()


def test_files_are_private_to_the_user(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path / "kv", 1000, 60.0)
    store.put(H[0], [b"abc"])
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "kv" / H[0]).stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "kv").iterdir()] == [H[0]]  # no temporary file left behind


def test_a_link_planted_under_a_handle_is_not_followed(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path / "kv", 1000, 60.0)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    (tmp_path / "kv" / H[0]).symlink_to(secret)
    assert store.get(H[0]) is None


def test_a_read_survives_the_delete_and_writes_to_it_stay_private(tmp_path: Path) -> None:
    """The decode side's view is a private mapping: its tensors may outlive the file, and nothing
    written through them reaches the file another reader maps."""
    store = FileKVStore(tmp_path / "kv", 1000, 60.0)
    store.put(H[0], [b"abcdef"])
    first, second = store.get(H[0]), store.get(H[0])
    assert isinstance(first, memoryview) and not first.readonly
    first[0] = ord("X")
    store.delete(H[0])
    assert bytes(first) == b"Xbcdef" and bytes(second) == b"abcdef"


def test_two_processes_share_one_bound(tmp_path: Path) -> None:
    """Two store objects over one directory (as two processes would be) evict each other's entries."""
    a, b = FileKVStore(tmp_path / "kv", 1000, 60.0), FileKVStore(tmp_path / "kv", 1000, 60.0)
    a.put(H[0], [b"a" * 600])
    _age_apart(a, H[0])
    b.put(H[1], [b"b" * 600])
    assert a.get(H[0]) is None and a.get(H[1]) == b"b" * 600 and a.num_bytes == 600


def _mtime(store: FileKVStore, handle: str) -> float:
    return (store.directory / handle).stat().st_mtime


def _age_apart(store: KVStore, handle: str) -> None:
    """Make `handle` strictly older than anything written next (file times can tie within a tick)."""
    if isinstance(store, FileKVStore):
        for written, _, path in store.entries():
            os.utime(path, (written - 1.0, written - 1.0))
    elif isinstance(store, MemoryKVStore):
        clock = store._clock
        if isinstance(clock, Clock):
            clock.now += 1.0

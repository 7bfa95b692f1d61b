"""The KV store contract, one suite over the in-memory and the file implementation: round trip, the
byte bound (oldest evicted first), TTL, refused handles; and the file store's permissions, its bound
under writers in several processes and threads, and what a killed writer leaves."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.engine import kv_files
from pipeline.engine.kv_files import FileKVStore
from pipeline.engine.kv_store import KVStore, MemoryKVStore

ROOT = Path(__file__).resolve().parents[3]

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
    assert stat.S_IMODE((tmp_path / "kv" / ".ledger").stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [".ledger", H[0]]  # no temporary file left behind


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


def test_a_write_in_progress_counts_against_another_writers_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer A is held in the middle of its write; writer B (another store object, as another process
    would have) must fit its entry beside A's bytes in flight, not in their place."""
    a, b = FileKVStore(tmp_path / "kv", 1000, 60.0), FileKVStore(tmp_path / "kv", 1000, 60.0)
    assert a.put(H[0], [b"0" * 400])
    _age_apart(a, H[0])
    writing, go_on = threading.Event(), threading.Event()
    write_all = kv_files._write_all

    def held(fd: int, views: list[memoryview]) -> None:
        if threading.current_thread().name == "writer-a":
            writing.set()
            go_on.wait(10.0)
        write_all(fd, views)

    monkeypatch.setattr(kv_files, "_write_all", held)
    writer = threading.Thread(target=a.put, args=(H[1], [b"1" * 500]), name="writer-a")
    writer.start()
    assert writing.wait(10.0)
    assert b.put(H[2], [b"2" * 500])  # room made by evicting H0, the only entry that may go
    assert _on_disk(tmp_path / "kv") <= 1000
    assert b.put(H[3], [b"3" * 500])  # room made by evicting H2: A's bytes in flight are not evicted
    assert _on_disk(tmp_path / "kv") <= 1000
    go_on.set()
    writer.join(10.0)
    assert _on_disk(tmp_path / "kv") <= 1000
    assert [a.get(h) for h in H[:4]] == [None, b"1" * 500, None, b"3" * 500]


def test_a_put_scans_the_directory_only_when_its_list_of_the_oldest_runs_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path stays cheap: one scan for the first put (no ledger yet), then one per ten evictions
    here (the list a scan makes holds the ten entries there were), none while entries fit."""
    store = FileKVStore(tmp_path / "kv", 1000, 60.0)
    scans = []
    scan = FileKVStore._scan

    def counted(self: FileKVStore, ledger: object, now: float) -> None:
        scans.append(len(self))
        scan(self, ledger, now)  # type: ignore[arg-type]

    monkeypatch.setattr(FileKVStore, "_scan", counted)
    for i in range(30):
        assert store.put(f"{i:032x}", [b"x" * 100])
        assert store.num_bytes <= 1000
    assert scans == [0, 10, 10] and len(store) == 10


_WRITER = """
import sys
from pathlib import Path
from pipeline.engine.kv_files import FileKVStore

directory, max_bytes, index, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
store = FileKVStore(Path(directory), max_bytes, 60.0)
sys.stdin.readline()  # every writer starts together
for i in range(count):
    store.put(f"{index:08x}{i:024x}", [bytes([i % 256]) * size])
"""


def test_writers_in_several_processes_stay_under_one_bound(tmp_path: Path) -> None:
    """Four processes write into one directory at once; the bytes there (entries and writes in progress,
    looked at under the store's lock, so that no rename is seen twice) never exceed the bound."""
    directory, bound, size = tmp_path / "kv", 8 * 2**16, 2**16
    FileKVStore(directory, bound, 60.0)
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), str(bound), str(n), "40", str(size)],
                         cwd=ROOT, stdin=subprocess.PIPE, text=True)
        for n in range(4)
    ]
    for writer in writers:
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.close()
    most = 0
    while any(writer.poll() is None for writer in writers):
        most = max(most, _on_disk(directory, locked=True))
    assert [writer.wait(30.0) for writer in writers] == [0, 0, 0, 0]
    most = max(most, _on_disk(directory, locked=True))
    assert 0 < most <= bound
    assert not list(directory.glob(".*.tmp"))


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from pipeline.engine import kv_files

def half_then_killed(fd, views):
    os.write(fd, bytes(views[0][: len(views[0]) // 2]))
    os.kill(os.getpid(), signal.SIGKILL)

kv_files._write_all = half_then_killed
kv_files.FileKVStore(Path(sys.argv[1]), 1000, 60.0).put("%s", [b"k" * 600])
"""


def test_a_killed_writers_temporary_file_counts_until_it_is_stale_then_is_evicted(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER % H[0], str(directory)], cwd=ROOT, check=False)
    assert killed.returncode == -signal.SIGKILL
    (left,) = directory.glob(".*.tmp")
    store = FileKVStore(directory, 1000, 60.0)
    assert not store.put(H[1], [b"1" * 600])  # it may still be a writer at work: its bytes count
    assert _on_disk(directory) <= 1000 and store.get(H[0]) is None
    stale = time.time() - 61.0
    os.utime(left, (stale, stale))  # older than the TTL: no writer is at work on it
    assert store.put(H[1], [b"1" * 600])
    assert not left.exists() and store.get(H[1]) == b"1" * 600 and store.num_bytes == 600


def test_a_stale_temporary_file_is_removed_by_eviction(tmp_path: Path) -> None:
    """What a writer killed mid-write left before there was a ledger (in the name any version of the
    store writes), found by the scan of the first put."""
    (tmp_path / "kv").mkdir(mode=0o700)
    left = tmp_path / "kv" / f".{H[1]}.{12345}.tmp"
    left.write_bytes(b"x" * 300)
    stale = time.time() - 61.0
    os.utime(left, (stale, stale))
    store = FileKVStore(tmp_path / "kv", 1000, 60.0)
    assert store.put(H[2], [b"2" * 700])
    assert not left.exists() and store.num_bytes == 700


def _on_disk(directory: Path, locked: bool = False) -> int:
    """The bytes of every file a store wrote there (its ledger aside), read under the store's lock if `locked`."""
    fd = os.open(directory / ".ledger", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_EX)
        total = 0
        with os.scandir(directory) as listing:
            for entry in listing:
                if entry.name != ".ledger":
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
        return total
    finally:
        os.close(fd)


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

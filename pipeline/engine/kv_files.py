"""`FileKVStore`: the KV store of one host, one file per handle in a directory its prefill and decode
processes share (kv_store.py has the contract and the in-memory store)."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import mmap
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.engine.kv_store import HANDLE, Buffer, check_bounds, check_handle

__all__ = ["FileKVStore"]

_TEMPORARY = re.compile(r"\.[0-9a-f]{16,64}\.[0-9a-f]+\.tmp")  # a put's file until it is renamed to its handle


class FileKVStore:
    """One file per handle (mode 600) in a directory only this user can enter (mode 700), shared by the
    processes of one host and bounded across them: every file a `put` leaves there counts, entries and
    the temporary files of writes in progress alike.

    A ledger (`.ledger`: the bytes the directory holds, and when it was last scanned) is read and written
    under an exclusive `flock` of it, and everything that adds bytes or renames a file does so under that
    lock: a `put` reserves its size (creates its temporary file at full length) under it, writes without
    it, and renames the file under its handle under it again, so a reader never sees half a file and a
    concurrent writer counts the bytes in flight. The ledger never counts less than is on disk (a process
    killed between an unlink and the ledger's update leaves it counting more, until the next scan).

    Eviction goes by what is on disk, without a scan per write: a scan of the directory removes expired
    entries and stale temporary files, sets the ledger to what is left, and lists the entries oldest
    first; a `put` that does not fit evicts from the head of its process's list (anything written since
    is newer than all of them; one gone meanwhile is skipped), and scans only when there is no readable
    ledger, when its list runs out, and once per TTL. Otherwise a `put` costs two lock round trips (about
    2 us each) beside its write: 0.04 ms a small put into 2,000 entries (0.12 at the bound), against the
    ~9 ms of a scan per put before (tmpfs; docs/engine.md).

    A temporary file untouched for longer than the TTL is a writer's that was killed mid-write (or one so
    slow that its entry would be expired on arrival): a scan removes it, and that writer's `put`, if it
    is still alive, returns False. A write in progress is never evicted for another: when the bytes in
    flight leave no room, `put` returns False."""

    def __init__(self, directory: Path, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        check_bounds(max_bytes, ttl_s)
        self.directory = Path(directory)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._clock = clock
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.directory.lstat()
        if not self.directory.is_dir() or self.directory.is_symlink() or info.st_uid != os.getuid():
            raise ValueError(f"{self.directory} must be a directory of this user, not a link")
        os.chmod(self.directory, 0o700)
        self._ledger_path = self.directory / _LEDGER_NAME
        self._oldest: collections.deque[tuple[Path, int]] = collections.deque()  # (entry, inode) by age at this process's last scan

    def put(self, handle: str, parts: Sequence[Buffer]) -> bool:
        path = self.directory / check_handle(handle)
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(view) for view in views)
        if size > self.max_bytes:
            self.delete(handle)
            return False
        temporary = self.directory / f".{handle}.{os.urandom(8).hex()}.tmp"
        with self._locked() as ledger:
            if not self._make_room(ledger, size):
                return False
            fd = _reserve(temporary, size)
            ledger.total += size
        try:
            try:
                _write_all(fd, views)
            finally:
                os.close(fd)
            with self._locked() as ledger:
                replaced = _size(path)
                os.replace(temporary, path)
                ledger.forget(replaced)
        except FileNotFoundError:  # a scan took it for a dead writer's (it outlived the TTL)
            return False
        except BaseException:
            self._remove(temporary)
            raise
        return True

    def get(self, handle: str) -> Buffer | None:
        """The entry mapped copy-on-write (MAP_PRIVATE: a reader's tensors are writable and no write
        reaches the file); the mapping outlives a `delete` of the file and ends when the last view of it
        is gone. A file is never written in place once renamed under its handle (a new `put` replaces
        it), so what a reader mapped cannot shrink under it. Pages are mapped as they are first read: MAP_POPULATE would break copy-on-write for
        every page of a writable private mapping, a fresh copy of the whole entry (90-130 ms for 44 MiB
        here, against ~9 ms for the importer's read). Takes no lock unless the entry has expired."""
        path = self.directory / check_handle(handle)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # not there (or a link planted in its place)
            return None
        try:
            info = os.fstat(fd)
            if self._clock() - info.st_mtime > self.ttl_s:
                self._remove(path, info)
                return None
            if info.st_size == 0:
                return b""
            return memoryview(mmap.mmap(fd, info.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)

    def delete(self, handle: str) -> None:
        self._remove(self.directory / check_handle(handle))

    def entries(self) -> list[tuple[float, int, Path]]:
        """(write time, bytes, path) of every stored entry, oldest first."""
        return sorted((info.st_mtime, info.st_size, path) for stored, info, path in self._files() if stored)

    def __len__(self) -> int:
        return len(self.entries())

    @property
    def num_bytes(self) -> int:
        """The bytes the bound covers: the entries, and the temporary files of writes in progress."""
        return sum(info.st_size for _, info, _ in self._files())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[_Ledger]:
        """The ledger, under an exclusive lock held until the block ends (and written back unless it
        raised). A file descriptor of its own each time: `flock` excludes by open file, so threads of
        one process, and a forked child, exclude each other too; the kernel drops the lock of a killed
        process."""
        fd = os.open(self._ledger_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            ledger = _Ledger.read(fd)
            yield ledger
            ledger.write(fd)
        finally:
            os.close(fd)

    def _make_room(self, ledger: _Ledger, size: int) -> bool:
        """Whether `size` more bytes fit, once the oldest entries are evicted; under the lock. The
        directory is scanned when the ledger is unknown or a TTL old, and when this process's list of
        the oldest entries (from its last scan) runs out before they fit."""
        now = self._clock()
        if ledger.known and now - ledger.scanned_at <= self.ttl_s and self._evict(ledger, size):
            return True
        self._scan(ledger, now)
        return self._evict(ledger, size)

    def _scan(self, ledger: _Ledger, now: float) -> None:
        """Remove what expired (entries, and temporary files a killed writer left), count the rest into
        the ledger, and list the entries oldest first for `_evict`."""
        total, entries = 0, []
        for stored, info, path in self._files():
            if now - info.st_mtime > self.ttl_s:
                path.unlink(missing_ok=True)
                continue
            total += info.st_size
            if stored:
                entries.append((info.st_mtime, info.st_ino, path))
        ledger.total, ledger.known, ledger.scanned_at = total, True, now
        self._oldest = collections.deque((path, inode) for _, inode, path in sorted(entries))

    def _evict(self, ledger: _Ledger, size: int) -> bool:
        """Evict entries from the oldest listed until `size` more bytes fit; False if the list ran out.
        Entries written since the list was made are newer than every one on it; one gone meanwhile (or
        written anew under its handle) is skipped: whoever removed it took its bytes off the ledger."""
        while ledger.total + size > self.max_bytes:
            if not self._oldest:
                return False
            path, inode = self._oldest.popleft()
            try:
                info = os.lstat(path)
                if info.st_ino != inode:
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue
            ledger.forget(info.st_size)
        return True

    def _files(self) -> Iterator[tuple[bool, os.stat_result, Path]]:
        """(an entry, not a temporary file; its status; its path) of every file the bound covers."""
        with os.scandir(self.directory) as listing:
            for entry in listing:
                stored = HANDLE.fullmatch(entry.name) is not None
                if stored or _TEMPORARY.fullmatch(entry.name):
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed meanwhile
                        continue
                    yield stored, info, Path(entry.path)

    def _remove(self, path: Path, expected: os.stat_result | None = None) -> None:
        """Unlink `path` (only if it is still the file `expected`, when given: a `put` may have replaced
        it) and take its bytes off the ledger."""
        with self._locked() as ledger:
            try:
                info = os.lstat(path)
                if expected is not None and (info.st_dev, info.st_ino) != (expected.st_dev, expected.st_ino):
                    return
                os.unlink(path)
            except FileNotFoundError:
                return
            ledger.forget(info.st_size)


_LEDGER_NAME = ".ledger"
_LEDGER = struct.Struct("<qd")  # bytes the directory holds (-1: unknown), time of the last scan


@dataclass
class _Ledger:
    total: int  # bytes in the directory: never less than are there
    known: bool  # False: no ledger yet, or not one we wrote (the next put scans)
    scanned_at: float

    @classmethod
    def read(cls, fd: int) -> _Ledger:
        raw = os.pread(fd, _LEDGER.size, 0)
        total, scanned_at = _LEDGER.unpack(raw) if len(raw) == _LEDGER.size else (-1, 0.0)
        return cls(max(total, 0), total >= 0, scanned_at)

    def write(self, fd: int) -> None:
        os.pwrite(fd, _LEDGER.pack(self.total if self.known else -1, self.scanned_at), 0)

    def forget(self, size: int) -> None:
        self.total = max(0, self.total - size)


def _reserve(path: Path, size: int) -> int:
    """A new file at `path` of `size` bytes (a hole on tmpfs until written), open for writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _write_all(fd: int, views: list[memoryview]) -> None:
    """`views` written one after another with as few `writev` calls as the kernel allows."""
    pending = [view for view in views if len(view)]
    limit = os.sysconf("SC_IOV_MAX")
    while pending:
        written = os.writev(fd, pending[:limit])
        while pending and written >= len(pending[0]):
            written -= len(pending.pop(0))
        if written:
            pending[0] = pending[0][written:]

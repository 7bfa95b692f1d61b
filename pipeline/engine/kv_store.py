"""Where a prefilled sequence's KV waits for its decode worker, by handle (no torch).

    put(handle, parts)  keep the bytes of `parts` (a `KVState.to_buffers()`, one after another) under
                        `handle`, evicting the oldest entries to stay under the byte bound; False when it
                        cannot be kept (larger than the bound)
    get(handle)         the bytes (a buffer: a mapped file here), or None when they are gone: expired
                        (TTL), evicted, deleted, or kept where this store cannot reach (another host):
                        the caller then recomputes
    delete(handle)      forget it (the decode finished, or the request was cancelled)

`FileKVStore` keeps one file per handle under a directory that the prefill and decode processes of one
host share (on tmpfs, e.g. /dev/shm/..., it is shared memory; the kernel pages it, no disk I/O). It
writes the parts with `writev` and reads by mapping the file, so the bytes are copied once on the way in
(into the file's pages) and not at all on the way out (the importer copies them from the mapping into
its KV pool).
`MemoryKVStore` is the same contract inside one process (tests, one-process deployments).

A transport across hosts implements the same three calls with the handle naming where the bytes are:
prefill registers the KV buffers with the transfer engine (NIXL agents, Mooncake's transfer engine or
its store) and `put` publishes their descriptor; `get` on the decode host pulls them (RDMA/NVLink, or
TCP) into memory it owns. Nothing else changes: the Kafka message carries only the handle, and a `get`
that cannot reach the bytes returns None, so decode recomputes (docs/engine.md).
"""

from __future__ import annotations

import mmap
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

Buffer = bytes | bytearray | memoryview

__all__ = ["Buffer", "FileKVStore", "KVStore", "MemoryKVStore", "check_handle"]

_HANDLE = re.compile(r"[0-9a-f]{16,64}")  # what prefill makes (uuid4().hex): a file name, never a path


def check_handle(handle: str) -> str:
    """`handle` if it is one a store accepts (lower-case hex), else ValueError: a handle comes off the
    wire and names a file, so nothing else may pass."""
    if not _HANDLE.fullmatch(handle):
        raise ValueError(f"not a KV handle: {handle[:80]!r}")
    return handle


class KVStore(Protocol):
    max_bytes: int
    ttl_s: float

    def put(self, handle: str, parts: Sequence[Buffer]) -> bool: ...

    def get(self, handle: str) -> Buffer | None: ...

    def delete(self, handle: str) -> None: ...


class MemoryKVStore:
    """The contract in one process: an LRU of byte strings with a byte bound and a TTL."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        _check_bounds(max_bytes, ttl_s)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # oldest first
        self._bytes = 0

    def put(self, handle: str, parts: Sequence[Buffer]) -> bool:
        check_handle(handle)
        self.delete(handle)
        data = b"".join(parts)
        if len(data) > self.max_bytes:
            return False
        self._expire()
        while self._entries and self._bytes + len(data) > self.max_bytes:
            self._pop(next(iter(self._entries)))
        self._entries[handle] = (self._clock(), data)
        self._bytes += len(data)
        return True

    def get(self, handle: str) -> Buffer | None:
        check_handle(handle)
        self._expire()
        entry = self._entries.get(handle)
        return None if entry is None else entry[1]

    def delete(self, handle: str) -> None:
        if check_handle(handle) in self._entries:
            self._pop(handle)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _expire(self) -> None:
        now = self._clock()
        while self._entries and now - next(iter(self._entries.values()))[0] > self.ttl_s:
            self._pop(next(iter(self._entries)))

    def _pop(self, handle: str) -> None:
        _, data = self._entries.pop(handle)
        self._bytes -= len(data)


class FileKVStore:
    """One file per handle (mode 600) in a directory only this user can enter (mode 700), shared by the
    processes of one host. Bounded across processes: every `put` lists the directory, drops expired
    entries and evicts the oldest (by write time) until the new one fits. A file is written under a
    temporary name and renamed, so a reader never sees half of one."""

    def __init__(self, directory: Path, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        _check_bounds(max_bytes, ttl_s)
        self.directory = Path(directory)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._clock = clock
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.directory.lstat()
        if not self.directory.is_dir() or self.directory.is_symlink() or info.st_uid != os.getuid():
            raise ValueError(f"{self.directory} must be a directory of this user, not a link")
        os.chmod(self.directory, 0o700)

    def put(self, handle: str, parts: Sequence[Buffer]) -> bool:
        path = self.directory / check_handle(handle)
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(view) for view in views)
        if size > self.max_bytes:
            self.delete(handle)
            return False
        self._make_room(size, keep=handle)
        temporary = self.directory / f".{handle}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                _write_all(fd, views)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return True

    def get(self, handle: str) -> Buffer | None:
        """The entry mapped copy-on-write (MAP_PRIVATE: a reader's tensors are writable and no write
        reaches the file); the mapping outlives a `delete` of the file and ends when the last view of it
        is gone. A file is never written in place once renamed under its handle (a new `put` replaces
        it), so what a reader mapped cannot shrink under it. Pages are mapped as they are first read: MAP_POPULATE would break copy-on-write for
        every page of a writable private mapping, a fresh copy of the whole entry (90-130 ms for 44 MiB
        here, against ~9 ms for the importer's read)."""
        path = self.directory / check_handle(handle)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # not there (or a link planted in its place)
            return None
        try:
            info = os.fstat(fd)
            if self._clock() - info.st_mtime > self.ttl_s:
                path.unlink(missing_ok=True)
                return None
            if info.st_size == 0:
                return b""
            return memoryview(mmap.mmap(fd, info.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)

    def delete(self, handle: str) -> None:
        (self.directory / check_handle(handle)).unlink(missing_ok=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(write time, bytes, path) of every stored entry, oldest first."""
        found = []
        with os.scandir(self.directory) as listing:
            for entry in listing:
                if _HANDLE.fullmatch(entry.name):
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # another process evicted it meanwhile
                        continue
                    found.append((info.st_mtime, info.st_size, Path(entry.path)))
        return sorted(found)

    def __len__(self) -> int:
        return len(self.entries())

    @property
    def num_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def _make_room(self, size: int, keep: str) -> None:
        now = self._clock()
        live = []
        for written, length, path in self.entries():
            if now - written > self.ttl_s or path.name == keep:
                path.unlink(missing_ok=True)
            else:
                live.append((length, path))
        total = sum(length for length, _ in live)
        for length, path in live:  # oldest first
            if total + size <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= length


def _check_bounds(max_bytes: int, ttl_s: float) -> None:
    if max_bytes < 1 or ttl_s <= 0:
        raise ValueError(f"a KV store needs a positive byte bound and TTL, got {max_bytes} bytes, {ttl_s} s")


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

"""Where a prefilled sequence's KV waits for its decode worker, by handle (no torch).

    put(handle, parts)  keep the bytes of `parts` (a `KVState.to_buffers()`, one after another) under
                        `handle`, evicting the oldest entries to stay under the byte bound; False when it
                        cannot be kept (larger than the bound, or writes in progress hold the room)
    get(handle)         the bytes (a buffer: a mapped file here), or None when they are gone: expired
                        (TTL), evicted, deleted, or kept where this store cannot reach (another host):
                        the caller then recomputes
    delete(handle)      forget it (the decode finished, or the request was cancelled)

`FileKVStore` (kv_files.py) keeps one file per handle under a directory that the prefill and decode processes of one
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

import collections
import re
import time
from collections.abc import Callable, Sequence
from typing import Protocol

Buffer = bytes | bytearray | memoryview

__all__ = ["Buffer", "KVStore", "MemoryKVStore", "check_bounds", "check_handle"]

HANDLE = re.compile(r"[0-9a-f]{16,64}")  # what prefill makes (uuid4().hex): a file name, never a path


def check_handle(handle: str) -> str:
    """`handle` if it is one a store accepts (lower-case hex), else ValueError: a handle comes off the
    wire and names a file, so nothing else may pass."""
    if not HANDLE.fullmatch(handle):
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
        check_bounds(max_bytes, ttl_s)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._clock = clock
        self._entries: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()  # oldest first
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


def check_bounds(max_bytes: int, ttl_s: float) -> None:
    if max_bytes < 1 or ttl_s <= 0:
        raise ValueError(f"a KV store needs a positive byte bound and TTL, got {max_bytes} bytes, {ttl_s} s")

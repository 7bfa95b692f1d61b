"""The in-process KV store: prefilled sequences waiting for their decode, by opaque handle.

Bounded: when full, the least recently stored sequence is evicted, and its decode recomputes the
KV state from the prompt (exactly as a decode worker in another process does).
"""

from __future__ import annotations

from collections import OrderedDict

from pipeline.backends.sequence import Sequence

__all__ = ["KVStore"]


class KVStore:
    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"KV store capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[str, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle: object) -> bool:
        return handle in self._entries

    def put(self, handle: str, sequence: Sequence) -> None:
        """Keep `sequence` under `handle`, evicting the oldest entry when the store is full."""
        self._entries[handle] = sequence
        self._entries.move_to_end(handle)
        while len(self._entries) > self._capacity:
            _, evicted = self._entries.popitem(last=False)
            evicted.cache = None

    def take(self, handle: str, request_id: str) -> Sequence | None:
        """Remove and return the sequence under `handle` if it belongs to `request_id`."""
        sequence = self._entries.get(handle)
        if sequence is None or sequence.request_id != request_id:
            return None
        del self._entries[handle]
        return sequence

    def drop(self, handle: str) -> bool:
        """Free the state under `handle`; False if there was none."""
        sequence = self._entries.pop(handle, None)
        if sequence is None:
            return False
        sequence.cache = None
        return True

    def drop_request(self, request_id: str) -> int:
        """Free every state that belongs to `request_id`; returns how many there were."""
        handles = [h for h, s in self._entries.items() if s.request_id == request_id]
        for handle in handles:
            self.drop(handle)
        return len(handles)

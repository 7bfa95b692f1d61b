"""Which offset of a partition is safe to commit while messages finish out of order."""

from __future__ import annotations

import heapq


class OffsetTracker:
    """Offsets started and finished on one partition. `committable()` is one past the highest offset
    below which everything has finished, so a commit never skips a message still in flight."""

    def __init__(self) -> None:
        self._pending: list[int] = []  # heap of started, unfinished offsets
        self._finished: set[int] = set()
        self._highest_finished = -1
        self._committed = -1

    def start(self, offset: int) -> None:
        heapq.heappush(self._pending, offset)

    def finish(self, offset: int) -> None:
        self._finished.add(offset)
        self._highest_finished = max(self._highest_finished, offset)
        while self._pending and self._pending[0] in self._finished:
            self._finished.discard(heapq.heappop(self._pending))

    def committable(self) -> int | None:
        """The next offset to commit if it moved since the last `mark_committed`, else None."""
        low = self._pending[0] if self._pending else self._highest_finished + 1
        return low if low > self._committed and low > 0 else None

    def mark_committed(self, offset: int) -> None:
        self._committed = offset

    @property
    def in_flight(self) -> int:
        return len(self._pending)

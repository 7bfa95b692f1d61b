"""Where batch jobs and their progress live: the JobStore protocol and its in-memory twin.

    jobs        create (refused past the tenant's unfinished jobs), get, update (compare-and-set on the
                status), list per tenant (newest first, paged)
    workers     active (the ids of unfinished jobs, oldest first), deactivate, lease and release (one worker
                drives a job at a time)
    progress    record (one line's outcome, once: the first record of a key wins and counts), recorded_keys,
                results, counts, forget_results (once the job has ended, its files written)

The Redis implementation (redis_store.py, Lua in lua/) is the one that runs; this one has the same
semantics for unit tests and one process. A job's progress is what makes it resumable: a worker that
takes a job over reads `recorded_keys` and runs only the other lines, and `record` refusing a second
outcome for a key is what keeps one output line per `custom_id` when a line in flight ran twice.

Nothing is kept for ever: a job (record, outcomes, counts) is gone `keep_s` after its completion window
closes, or `keep_s` after it ends if it ends first (redis_store.py says why even a running one expires).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Protocol

from pipeline.batch.records import TERMINAL, Batch, Counts, Recorded, Status


class JobStore(Protocol):
    async def create(self, batch: Batch, *, listed: bool = True, max_active: int = 0) -> bool:
        """Stores a new job; `listed`: in its tenant's list and `active` (for the bridge's workers). A
        direct job (`sluice batch run`) is not: only the process that runs it drives it. False (nothing
        stored) when the tenant already has `max_active` listed jobs unfinished (0: no limit); a job counts
        until it is deactivated or its completion window closes."""

    async def get(self, batch_id: str) -> Batch | None: ...

    async def update(self, batch: Batch, expect: Collection[Status]) -> bool:
        """Stores `batch` only if the stored status is one of `expect`; True when it did. A terminal
        status ends the job: its record, outcomes and counts expire after `keep_s` (the caller then
        deactivates it)."""

    async def list(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The tenant's jobs, newest first, starting after the id `after`; and whether more follow."""

    async def active(self) -> list[str]:
        """The ids of unfinished listed jobs, sorted: oldest first (records.new_batch_id)."""

    async def deactivate(self, batch_id: str, tenant: str | None = None) -> None:
        """The job leaves `active` and, given its tenant, the tenant's count (None: the record is gone, and
        so is the job's place in that count, with its window)."""

    async def lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Takes or renews the job's lease for `owner`; False while another owner holds it."""

    async def release(self, batch_id: str, owner: str) -> None: ...

    async def record(self, batch_id: str, key: str, outcome: Recorded) -> bool:
        """Records the outcome of the line `key` unless one is recorded or the job has ended; True when this
        call recorded it."""

    async def recorded_keys(self, batch_id: str) -> set[str]: ...

    async def results(self, batch_id: str) -> list[Recorded]: ...

    async def counts(self, batch_id: str) -> Counts: ...

    async def forget_results(self, batch_id: str) -> None:
        """Drops the job's outcomes; called only after the compare-and-set that ended the job, which is what
        lets a finalizer tell a complete read from one cut short (worker.BatchWorker._finalize)."""

    async def aclose(self) -> None: ...


class MemoryJobStore:
    """JobStore in this process's memory. Atomic because no method awaits."""

    def __init__(self, *, keep_s: float = 30 * 24 * 3600.0, clock: Callable[[], float] = time.time) -> None:
        self._keep_s = keep_s
        self._clock = clock
        self._jobs: dict[str, tuple[Batch, float]] = {}  # id -> (record, when its state expires), oldest first
        self._active: set[str] = set()
        self._places: dict[str, dict[str, float]] = {}  # tenant -> its unfinished listed jobs -> window end
        self._unlisted: set[str] = set()
        self._leases: dict[str, tuple[str, float]] = {}
        self._results: dict[str, dict[str, Recorded]] = {}
        self._counts: dict[str, Counts] = {}

    async def create(self, batch: Batch, *, listed: bool = True, max_active: int = 0) -> bool:
        if listed:
            now = self._clock()
            places = self._places.setdefault(batch.tenant, {})
            for job_id in [j for j, window_end in places.items() if window_end <= now]:
                del places[job_id]
            if max_active and len(places) >= max_active:
                return False
            places[batch.id] = batch.expires_at
            self._active.add(batch.id)
        else:
            self._unlisted.add(batch.id)
        self._jobs[batch.id] = (batch, batch.expires_at + self._keep_s)
        return True

    async def get(self, batch_id: str) -> Batch | None:
        entry = self._jobs.get(batch_id)
        if entry is not None and entry[1] <= self._clock():  # expired, as Redis expires the job's keys
            del self._jobs[batch_id]
            self._results.pop(batch_id, None)
            self._counts.pop(batch_id, None)
            return None
        return None if entry is None else entry[0]

    async def update(self, batch: Batch, expect: Collection[Status]) -> bool:
        current = await self.get(batch.id)
        if current is None or current.status not in expect:
            return False
        expires = self._clock() + self._keep_s if batch.status in TERMINAL else self._jobs[batch.id][1]
        self._jobs[batch.id] = (batch, expires)
        return True

    async def list(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        now = self._clock()
        mine = [b for b, expires in reversed(self._jobs.values())
                if b.tenant == tenant and expires > now and b.id not in self._unlisted]
        start = 0
        if after is not None:
            ids = [b.id for b in mine]
            start = ids.index(after) + 1 if after in ids else len(mine)
        page = mine[start : start + limit]
        return page, start + limit < len(mine)

    async def active(self) -> list[str]:
        return sorted(self._active)

    async def deactivate(self, batch_id: str, tenant: str | None = None) -> None:
        self._active.discard(batch_id)
        if tenant is not None:
            self._places.get(tenant, {}).pop(batch_id, None)

    async def lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        now = self._clock()
        holder = self._leases.get(batch_id)
        if holder is not None and holder[0] != owner and holder[1] > now:
            return False
        self._leases[batch_id] = (owner, now + ttl_s)
        return True

    async def release(self, batch_id: str, owner: str) -> None:
        holder = self._leases.get(batch_id)
        if holder is not None and holder[0] == owner:
            del self._leases[batch_id]

    async def record(self, batch_id: str, key: str, outcome: Recorded) -> bool:
        batch = await self.get(batch_id)
        if batch is None or batch.status in TERMINAL:
            return False
        results = self._results.setdefault(batch_id, {})
        if key in results:
            return False
        results[key] = outcome
        counts = self._counts.get(batch_id, Counts())
        if outcome.ok:
            self._counts[batch_id] = Counts(0, counts.completed + 1, counts.failed)
        else:
            self._counts[batch_id] = Counts(0, counts.completed, counts.failed + 1)
        return True

    async def recorded_keys(self, batch_id: str) -> set[str]:
        await self.get(batch_id)  # forgets an expired job's outcomes
        return set(self._results.get(batch_id, {}))

    async def results(self, batch_id: str) -> list[Recorded]:
        await self.get(batch_id)
        return list(self._results.get(batch_id, {}).values())

    async def counts(self, batch_id: str) -> Counts:
        await self.get(batch_id)
        return self._counts.get(batch_id, Counts())

    async def forget_results(self, batch_id: str) -> None:
        self._results.pop(batch_id, None)

    async def aclose(self) -> None:
        pass


__all__ = ["JobStore", "MemoryJobStore"]

"""Runs a CPU-bound batch function in a worker thread, so the event loop keeps serving, and shares it
fairly between tenants.

Each caller submits a list of items (the slices of one request's texts) under its tenant. Items wait
in one queue per tenant; the next batch takes one item per tenant in turn, starting with the tenant
least recently served, until the batch's cost budget is spent. So a tenant with a 32 KB prompt (dozens
of slices) gets one slice per turn, and another tenant's small request goes into the very next batch:
it waits at most for the batch already running, whose cost the budget bounds. A lone request pays
nothing (no waiting window), and items queued together still run batched.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    def __init__(self, fn: Callable[[list[T]], list[R]], cost: Callable[[T], int] = lambda _: 1,
                 max_cost: int = 16, max_batch: int = 16) -> None:
        """`fn` maps a batch of items to their results; a batch holds at most `max_batch` items and, past
        its first item, at most `max_cost` of `cost(item)` together."""
        self._fn, self._cost, self._max_cost, self._max_batch = fn, cost, max_cost, max_batch
        self._queues: dict[str, deque[tuple[T, asyncio.Future[R]]]] = {}
        self._ring: deque[str] = deque()  # tenants with queued items; the next to serve first
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, tenant: str, items: list[T]) -> list[R]:
        """The results of `items`, in order, once every one has run."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        if tenant not in self._queues:
            self._queues[tenant] = deque()
            self._ring.appendleft(tenant)  # a newcomer is served next: it has had no turn yet
        self._queues[tenant].extend(zip(items, futures))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for future in futures:  # a cancelled or failed caller's remaining items are skipped, not run
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # retrieved, so asyncio does not report it as lost

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _take(self) -> list[tuple[T, asyncio.Future[R]]]:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        spent = 0
        while self._ring and len(batch) < self._max_batch:
            tenant = self._ring[0]
            queue = self._queues[tenant]
            while queue and queue[0][1].done():
                queue.popleft()
            if not queue:
                self._ring.popleft()
                del self._queues[tenant]
                continue
            cost = self._cost(queue[0][0])
            if batch and spent + cost > self._max_cost:
                break
            batch.append(queue.popleft())
            spent += cost
            self._ring.rotate(-1)  # this tenant goes to the back of the ring
        return batch

    async def _run(self) -> None:
        while batch := self._take():
            try:
                results = await asyncio.to_thread(self._fn, [item for item, _ in batch])
            except Exception as exc:  # handed to every caller in the batch, each of which re-raises it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # a caller that was cancelled meanwhile
                    future.set_result(result)

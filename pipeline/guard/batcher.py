"""Runs a CPU-bound batch function in a worker thread, so the event loop keeps serving other stages.

Requests that arrive while a batch is running queue up and go together in the next call: no waiting
window, so a lone request pays nothing, and under load the NLP and embedding passes run batched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    def __init__(self, fn: Callable[[list[T]], list[R]], max_batch: int = 16) -> None:
        self._fn = fn
        self._max_batch = max_batch
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
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

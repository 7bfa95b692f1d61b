"""Admission: how a worker's lines enter the pipeline. At most `max_in_flight` lines at once and at most
`rate` starts per second, over every job the worker drives (one `Admission` per worker), so a backfill
cannot flood ingest and the engine's interactive lane keeps its latency (the engine also schedules
batch-lane work behind interactive work, pipeline/engine/scheduler.py).

`feed(lines, run, admission, stop)` runs `run(line)` for each line (taken from the async iterable as
slots free up, so a job's file is read as fast as its lines run) and returns True when every one has
finished, or False as soon as `stop` is set: the lines still in flight are cancelled (their SDK streams
tell the pipeline to stop them) and were not recorded, so whoever resumes the job runs them again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Admission:
    def __init__(self, max_in_flight: int, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = asyncio.Semaphore(max_in_flight)
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._next = 0.0
        self._clock = clock

    async def pace(self) -> None:
        """Waits for this start's turn: starts are spaced `1 / rate` apart (no bursts past one)."""
        if not self._interval:
            return
        now = self._clock()
        turn = max(self._next, now)
        self._next = turn + self._interval
        if turn > now:
            await asyncio.sleep(turn - now)


async def feed(lines: AsyncIterable[T], run: Callable[[T], Awaitable[None]], admission: Admission, stop: asyncio.Event) -> bool:
    tasks: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []  # a `run` that raised: a bug, re-raised here
    stopping = asyncio.create_task(stop.wait())

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        admission.slots.release()
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    try:
        async for line in lines:
            acquire = asyncio.create_task(admission.slots.acquire())
            await asyncio.wait((acquire, stopping), return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                if not acquire.cancel():  # acquired after all: give it back
                    admission.slots.release()
                return False
            if failures:
                admission.slots.release()
                raise failures[0]
            await admission.pace()
            task = asyncio.create_task(run(line))
            tasks.add(task)
            task.add_done_callback(finished)
        while tasks:
            await asyncio.wait((*tasks, stopping), return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                return False
        if failures:
            raise failures[0]
        return True
    finally:
        stopping.cancel()
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

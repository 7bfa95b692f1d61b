"""The batcher runs queued items together in a worker thread and hands errors to every caller."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.guard.batcher import Batcher

pytestmark = pytest.mark.asyncio


async def test_items_queued_while_a_batch_runs_go_together() -> None:
    sizes: list[int] = []

    def double(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return [i * 2 for i in items]

    batcher: Batcher[int, int] = Batcher(double, max_batch=4)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    assert results == [0, 2, 4, 6, 8, 10]
    assert sum(sizes) == 6 and max(sizes) <= 4 and len(sizes) < 6


async def test_an_error_reaches_every_caller_of_the_batch() -> None:
    def fail(items: list[int]) -> list[int]:
        raise ValueError("broken")

    batcher: Batcher[int, int] = Batcher(fail)
    results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)

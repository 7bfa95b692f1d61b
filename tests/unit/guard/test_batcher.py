"""The batcher runs queued items together in a worker thread, takes turns between tenants within a
cost budget, and hands errors to every caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeline.guard.batcher import Batcher

pytestmark = pytest.mark.asyncio


async def test_items_queued_while_a_batch_runs_go_together() -> None:
    sizes: list[int] = []

    def double(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return [i * 2 for i in items]

    batcher: Batcher[int, int] = Batcher(double, max_cost=4)
    results = await asyncio.gather(*(batcher.submit(f"t{i}", [i]) for i in range(6)))
    assert results == [[0], [2], [4], [6], [8], [10]]
    assert sum(sizes) == 6 and max(sizes) <= 4 and len(sizes) < 6


async def test_a_request_gets_its_results_in_order() -> None:
    batcher: Batcher[int, int] = Batcher(lambda items: [i + 1 for i in items], max_cost=3)
    assert await batcher.submit("a", list(range(10))) == list(range(1, 11))


async def test_another_tenant_does_not_wait_behind_a_large_request() -> None:
    batches: list[list[str]] = []
    gate = threading.Event()

    def run(items: list[str]) -> list[str]:
        gate.wait(5)
        batches.append(items)
        return items

    batcher: Batcher[str, str] = Batcher(run, cost=len, max_cost=4)
    large = asyncio.create_task(batcher.submit("big", [f"b{i:02}" for i in range(20)]))  # 20 items of cost 3
    await asyncio.sleep(0.05)  # the first batch is running
    small = asyncio.create_task(batcher.submit("small", ["s"]))
    await asyncio.sleep(0.05)
    gate.set()
    assert await small == ["s"]
    assert len(await large) == 20
    assert "s" in batches[1], batches  # in the batch right after the one that was running, not after all 20


async def test_turns_alternate_between_tenants() -> None:
    order: list[str] = []

    def run(items: list[str]) -> list[str]:
        order.extend(items)
        return items

    batcher: Batcher[str, str] = Batcher(run, max_cost=1)
    await asyncio.gather(batcher.submit("a", ["a1", "a2", "a3"]), batcher.submit("b", ["b1", "b2", "b3"]))
    assert [item[0] for item in order] in (list("ababab"), list("bababa")), order


async def test_a_batch_stays_within_its_cost_budget_but_always_takes_one_item() -> None:
    batches: list[list[str]] = []
    batcher: Batcher[str, str] = Batcher(lambda items: batches.append(items) or items, cost=len, max_cost=5)
    await asyncio.gather(batcher.submit("a", ["xxxxxxxx", "yy", "zz"]), batcher.submit("b", ["ww"]))
    assert all(len(b) == 1 or sum(map(len, b)) <= 5 for b in batches), batches
    assert sorted(i for b in batches for i in b) == ["ww", "xxxxxxxx", "yy", "zz"]


async def test_an_error_reaches_every_caller_of_the_batch() -> None:
    def fail(items: list[int]) -> list[int]:
        raise ValueError("broken")

    batcher: Batcher[int, int] = Batcher(fail)
    results = await asyncio.gather(batcher.submit("a", [1]), batcher.submit("b", [2, 3]), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)

"""Admission: at most max_in_flight lines at once, starts spaced by the rate, and a stop cancels what is
in flight without recording it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pipeline.batch.feeder import Admission, feed

pytestmark = pytest.mark.asyncio


async def numbers(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


async def test_starts_are_spaced_by_the_rate() -> None:
    starts: list[float] = []

    async def run(line: int) -> None:
        starts.append(time.monotonic())

    assert await feed(numbers(6), run, Admission(10, rate=50.0), asyncio.Event())
    # Start k comes no sooner than k / 50 s after the first (less timer slack). Gaps between neighbours
    # are not the claim: a start that a busy machine delayed is followed by its on-time successor.
    assert len(starts) == 6
    assert all(at - starts[0] >= k / 50 - 0.003 for k, at in enumerate(starts)), [at - starts[0] for at in starts]


async def test_a_stop_cancels_the_lines_in_flight_and_starts_no_more() -> None:
    started: list[int] = []
    finished: list[int] = []
    stop = asyncio.Event()

    async def run(line: int) -> None:
        started.append(line)
        if len(started) == 3:
            stop.set()
        await asyncio.sleep(10)
        finished.append(line)

    admission = Admission(3, rate=0.0)
    assert not await asyncio.wait_for(feed(numbers(10), run, admission, stop), 2)
    assert started == [0, 1, 2] and finished == []
    assert admission.slots._value == 3  # every slot given back


async def test_a_failing_line_is_a_bug_and_raises() -> None:
    async def run(line: int) -> None:
        if line == 2:
            raise RuntimeError("bug")
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="bug"):
        await feed(numbers(50), run, Admission(2, rate=0.0), asyncio.Event())

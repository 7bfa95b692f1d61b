"""A message the infrastructure failed is tried again after a backoff (0.1 s doubling to 5 s) that another
message's success cuts short: the broker or Redis answers again, so it goes at once (pipeline/handling.py,
`Backoff`). A hung Redis cost up to 5.7 s after it answered again before (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pipeline import handling
from pipeline.errors import InfraUnavailable
from pipeline.handling import WOKEN_AFTER_S, Backoff, Handling
from pipeline.settings import Settings
from pipeline.stage import Out
from pipeline.topology import Topics
from tests.unit import helpers
from tests.unit.fakes import HeldAcks, record_of
from topics.hops import Admitted


async def timed(wait: Any) -> float:
    start = time.monotonic()
    await wait
    return time.monotonic() - start


@pytest.mark.asyncio
async def test_a_success_cuts_a_backoff_short_but_not_below_its_floor() -> None:
    backoff = Backoff()
    waiting = asyncio.create_task(timed(backoff.wait(3.0)))
    await asyncio.sleep(0.05)
    backoff.through()
    assert WOKEN_AFTER_S - 0.01 <= await waiting < 1.5


@pytest.mark.asyncio
async def test_a_backoff_runs_its_length_when_nothing_gets_through_meanwhile() -> None:
    backoff = Backoff()
    backoff.through()  # before the wait began: says nothing about the failure after it
    assert await timed(backoff.wait(0.3)) >= 0.29


@pytest.mark.asyncio
async def test_a_short_backoff_is_not_lengthened_by_the_floor() -> None:
    backoff = Backoff()
    waiting = asyncio.create_task(timed(backoff.wait(0.1)))
    await asyncio.sleep(0.02)
    backoff.through()
    assert await waiting < 0.3


class FailsFirstTry:
    """A stage that fails the first try of message `flaky` as if Redis were away, and handles the rest."""

    name = "flaky"
    topics = Topics(("t.in",), None, "t.stream")
    input_type = Admitted
    ordered = False

    def __init__(self, flaky: str) -> None:
        self.flaky = flaky
        self.tries: Counter[str] = Counter()

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        self.tries[message.id] += 1
        if message.id == self.flaky and self.tries[message.id] == 1:
            raise InfraUnavailable("redis state store: TimeoutError")
        for out in ():
            yield out


@pytest.mark.asyncio
async def test_a_message_waiting_out_its_backoff_goes_once_another_gets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handling, "FIRST_BACKOFF_S", 5.0)  # as far as it grows in an outage of seconds
    first, second = helpers.admitted(helpers.request("a")), helpers.admitted(helpers.request("b"))
    stage = FailsFirstTry(first.id)
    run = Handling(stage, Settings(), HeldAcks())  # type: ignore[arg-type]
    failed = asyncio.create_task(timed(run.process(record_of(first), None)))
    await asyncio.sleep(0.1)
    assert stage.tries[first.id] == 1 and not failed.done()  # backing off
    assert await run.process(record_of(second), None) == "ok"  # the infrastructure answers again
    assert await asyncio.wait_for(failed, 2.0) < 1.5  # not 5 s
    assert stage.tries[first.id] == 2

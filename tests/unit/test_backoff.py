"""A message the infrastructure failed is tried again after a backoff (0.1 s doubling to 5 s); one waiting
message at a time is a probe, tried again within `PROBE_S`, and any message that gets through ends every
wait: the broker or Redis answers again (pipeline/handling.py, `Backoff`). Before, a hung Redis cost up to
5.7 s after it answered again (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pipeline import handling
from pipeline.backoff import PROBE_S, Backoff
from pipeline.errors import InfraUnavailable
from pipeline.handling import Handling
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
async def test_one_waiting_message_is_a_probe_the_others_wait_their_backoff() -> None:
    backoff = Backoff()
    probe = asyncio.create_task(timed(backoff.wait(3.0)))
    other = asyncio.create_task(timed(backoff.wait(3.0)))
    assert PROBE_S - 0.01 <= await probe < 1.5
    await asyncio.sleep(0.3)
    assert not other.done()  # its own backoff, until something gets through
    backoff.through()
    assert await asyncio.wait_for(other, 1.0) < 1.5


@pytest.mark.asyncio
async def test_a_success_cuts_a_backoff_short_but_not_below_the_probe_interval() -> None:
    backoff = Backoff()
    probe = asyncio.create_task(backoff.wait(3.0))
    waiting = asyncio.create_task(timed(backoff.wait(3.0)))
    await asyncio.sleep(0.05)
    backoff.through()
    assert PROBE_S - 0.01 <= await waiting < 1.5
    await probe


@pytest.mark.asyncio
async def test_a_backoff_runs_its_length_when_nothing_gets_through_meanwhile() -> None:
    backoff = Backoff()
    backoff.through()  # before the wait began: says nothing about the failure after it
    assert await timed(backoff.wait(0.3)) >= 0.29  # shorter than PROBE_S: no probe


@pytest.mark.asyncio
async def test_a_short_backoff_is_not_lengthened_by_the_probe_interval() -> None:
    backoff = Backoff()
    waiting = asyncio.create_task(timed(backoff.wait(0.1)))
    await asyncio.sleep(0.02)
    backoff.through()
    assert await waiting < 0.3


class FailsFirstTry:
    """A stage that fails the first try of the messages named `flaky` as if Redis were away."""

    name = "flaky"
    topics = Topics(("t.in",), None, "t.stream")
    input_type = Admitted
    ordered = False

    def __init__(self, *flaky: str) -> None:
        self.flaky = set(flaky)
        self.tries: Counter[str] = Counter()

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        self.tries[message.id] += 1
        if message.id in self.flaky and self.tries[message.id] == 1:
            raise InfraUnavailable("redis state store: TimeoutError")
        for out in ():
            yield out


@pytest.mark.asyncio
async def test_messages_waiting_out_long_backoffs_go_once_the_probe_gets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handling, "FIRST_BACKOFF_S", 5.0)  # as far as it grows in an outage of seconds
    messages = [helpers.admitted(helpers.request(rid)) for rid in ("a", "b", "c")]
    stage = FailsFirstTry(*(m.id for m in messages))
    run = Handling(stage, Settings(), HeldAcks())  # type: ignore[arg-type]
    tries = [asyncio.create_task(timed(run.process(record_of(m), None))) for m in messages]
    await asyncio.sleep(0.1)
    assert all(stage.tries[m.id] == 1 for m in messages) and not any(t.done() for t in tries)  # backing off
    spent = await asyncio.wait_for(asyncio.gather(*tries), 3.0)
    assert max(spent) < 1.6  # the probe after 0.5 s, the others at least 0.5 s after they began: not 5 s
    assert all(stage.tries[m.id] == 2 for m in messages)

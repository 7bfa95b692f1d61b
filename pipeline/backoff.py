"""How long a stage's messages wait before they are tried again after the infrastructure failed them
(`pipeline.handling`), and what ends the wait early."""

from __future__ import annotations

import asyncio

PROBE_S = 0.5  # how soon one waiting message of a stage is tried again, whatever its backoff (a probe)


class Backoff:
    """The waits before messages of one stage are tried again after the infrastructure failed them:
    `wait(seconds)` (`handling.FIRST_BACKOFF_S` doubling to `MAX_BACKOFF_S`). One waiting message at a time is a
    probe and waits at most PROBE_S; once any message gets through (`through`), the broker or Redis
    answers again and every wait ends, so what waited goes at once instead of up to MAX_BACKOFF_S later
    (a hung Redis cost up to 5.7 s after it answered). A wait so ended lasts at least PROBE_S: where only
    some messages fail (one store of two away) the others' successes do not make a busy loop of it."""

    def __init__(self) -> None:
        self._waiting = 0
        self._through = asyncio.Event()
        self._probing = False

    def through(self) -> None:
        if self._waiting:  # nobody waits on almost every success: nothing to do
            self._through.set()
            self._through = asyncio.Event()

    async def wait(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        start, through = loop.time(), self._through
        probe = not self._probing and seconds > PROBE_S
        if probe:
            self._probing, seconds = True, PROBE_S
        self._waiting += 1
        try:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that comes
                async with asyncio.timeout(seconds):  # as the wait ends (a revoke's, at a `through`)
                    await through.wait()
            except TimeoutError:
                return
            if (left := min(seconds, PROBE_S) - (loop.time() - start)) > 0:
                await asyncio.sleep(left)
        finally:
            self._waiting -= 1
            if probe:
                self._probing = False

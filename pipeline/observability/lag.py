"""Consumer lag per stage and partition: the input partition's high watermark (from the consumer's last
fetch) minus the stage's position (the next offset it will fetch). Read every
`observability.lag_interval_s` in a task of its own, so the runner's poll loop never waits on it; a
partition the stage no longer owns loses its series."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pipeline import metrics

log = logging.getLogger(__name__)


class LagWatch:
    def __init__(self, stage: str, interval_s: float = 5.0) -> None:
        self.stage = stage
        self.interval_s = interval_s
        self._next = 0.0
        self._task: asyncio.Task[None] | None = None
        self._series: set[tuple[str, str]] = set()

    def observe(self, consumer: Any) -> None:
        """Called from the poll loop: starts a reading when one is due and none is running."""
        now = time.monotonic()
        if now < self._next or (self._task is not None and not self._task.done()):
            return
        self._next = now + self.interval_s
        self._task = asyncio.get_running_loop().create_task(self._read(consumer))

    async def _read(self, consumer: Any) -> None:
        seen: set[tuple[str, str]] = set()
        try:
            for tp in consumer.assignment():
                high = consumer.highwater(tp)
                if high is None:
                    continue
                position = await asyncio.wait_for(consumer.position(tp), 1.0)
                series = (tp.topic, str(tp.partition))
                metrics.CONSUMER_LAG.labels(self.stage, *series).set(max(0, high - position))
                seen.add(series)
        except Exception as exc:  # a rebalance or an outage in the middle: the next reading tries again
            log.debug("stage=%s lag not read (%s)", self.stage, type(exc).__name__)
            return
        for topic, partition in self._series - seen:
            metrics.CONSUMER_LAG.remove(self.stage, topic, partition)
        self._series = seen

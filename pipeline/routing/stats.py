"""What a generation worker counts of its backend, and reports on `llm.backend.health` (topics.health).

One `BackendStats` per (backend, stage) in a process. The stage tells it when a request starts, when
its first token came, and how it ended; the runner asks for a report once a second (`Reporting`), and
the stage publishes one at once when a failure streak reaches the ejection threshold, so every route
process ejects the backend within milliseconds of its N-th consecutive failure.

An ejection lasts its whole term, as Envoy's does: a success while it runs (a stream that started before
the ejection, or a last-resort request) does not end it, and `ejections`, which makes each term in a row
longer, goes back to 0 only with a success after the term. Streaks are this worker's own: a backend
served by N workers (or generation stages) can take up to N x `eject_after` failures before one of
them reaches the threshold (route ejects it when any worker's streak does).
"""

from __future__ import annotations

import time
from collections import deque

from pipeline.routing.config import RoutingSettings
from topics.health import BackendHealth

WINDOW_S = 60.0  # time to first token and error rate over this window


class BackendStats:
    def __init__(self, backend: str, pool: str, worker: str, capacity: int, eject_after: int = 5,
                 routing: RoutingSettings | None = None) -> None:
        """`routing`: the ejection terms (`ejection_s`, `max_ejection_s`); its `eject_after` is not read."""
        self.backend, self.pool, self.worker = backend, pool, worker
        self._capacity = max(capacity, 1)
        self._eject_after = eject_after
        self._routing = routing or RoutingSettings()
        self.in_flight = 0
        self.streak = 0
        self.ejections = 0
        self.streak_at = 0.0
        self._ttft: deque[tuple[float, float]] = deque(maxlen=1024)  # (at, ms)
        self._ends: deque[tuple[float, bool]] = deque(maxlen=4096)  # (at, failed)

    def started(self) -> None:
        self.in_flight += 1

    def abandoned(self) -> None:
        """A request left this worker without an outcome of the backend's (retried later, taken over)."""
        self.in_flight = max(0, self.in_flight - 1)

    def first_token(self, ms: float) -> None:
        self._ttft.append((time.time(), ms))

    def finished(self, *, failed: bool) -> bool:
        """A request ended; `failed`: the backend failed it (retriable). True when this failure made the
        streak reach the ejection threshold: the caller publishes a report at once."""
        self.in_flight = max(0, self.in_flight - 1)
        now = time.time()
        self._ends.append((now, failed))
        if not failed:
            if not self.ejected(now):
                self.streak = self.ejections = 0
            return False
        self.streak += 1
        if self.streak % self._eject_after == 0:
            self.ejections += 1
            self.streak_at = now
            return True
        return False

    def ejected(self, now: float) -> bool:
        """This worker's streak has its backend ejected now (the term HealthView reads off its reports)."""
        return self.streak >= self._eject_after and now < self.streak_at + self._routing.term_s(self.ejections)

    def report(self) -> BackendHealth:
        now = time.time()
        ttft = sorted(ms for at, ms in self._ttft if now - at <= WINDOW_S)
        ends = [failed for at, failed in self._ends if now - at <= WINDOW_S]
        return BackendHealth(
            backend=self.backend, pool=self.pool, worker=self.worker, at=now, in_flight=self.in_flight,
            capacity=self._capacity, streak=self.streak, ejections=self.ejections, streak_at=self.streak_at,
            ttft_p95_ms=ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] if ttft else 0.0,
            error_rate=sum(ends) / len(ends) if ends else 0.0,
        )

    @property
    def key(self) -> str:
        return f"{self.backend}/{self.worker}"

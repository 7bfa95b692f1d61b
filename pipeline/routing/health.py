"""What route knows of each backend: the latest report of each of its workers on `llm.backend.health`,
folded into one view per backend (load, ejection, time to first token). Every route process folds the
same records, so they agree on who is ejected without talking to each other.

A report comes once a second; meanwhile this route process counts what it sent to each backend since the
backend's last report was folded in (`sent`) and adds it to the load, so that power of two choices does
not send a whole second's traffic to the backend that looked lighter at the last report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from pipeline.routing.config import RoutingSettings
from topics.health import BackendHealth


@dataclass(frozen=True)
class Member:
    """One backend as route sees it now."""

    load: float  # (in flight + sent by this route process since) / capacity over its fresh reports (0: unknown)
    ejected: bool
    ttft_p95_ms: float  # 0: unknown
    known: bool  # a fresh report exists
    unit: float = 0.0  # the load one more request adds (1 / capacity); 0 when unknown
    silent: bool = False  # it reported before and has said nothing fresh since: its workers may be gone


MAX_WORKERS = 256  # reports kept per backend: every worker restart reports under a new name


UNKNOWN = Member(load=0.0, ejected=False, ttft_p95_ms=0.0, known=False)


class HealthView:
    def __init__(self, settings: RoutingSettings) -> None:
        self._settings = settings
        self._reports: dict[str, dict[str, BackendHealth]] = {}  # backend -> worker -> latest report
        self._sent: dict[str, int] = {}  # backend -> requests sent to it since its last report was folded in

    def sent(self, backend: str) -> None:
        """Counts a request route sent to `backend` (a configured one: one count per backend)."""
        self._sent[backend] = self._sent.get(backend, 0) + 1

    def apply(self, report: BackendHealth, now: float | None = None) -> None:
        """Folds in one report. Its times are the reporting worker's clock, taken no later than this
        one's `now` (a report from the future, or one record claiming an ejection until the year 33,000,
        would otherwise rule the backend until it expired); counts below zero read as zero."""
        now = time.time() if now is None else now
        if report.at > now or report.streak_at > now or report.in_flight < 0 or report.capacity < 0:
            report = msgspec.structs.replace(report, at=min(report.at, now), streak_at=min(report.streak_at, now),
                                             in_flight=max(report.in_flight, 0), capacity=max(report.capacity, 0))
        workers = self._reports.setdefault(report.backend, {})
        previous = workers.get(report.worker)
        if previous is None or report.at >= previous.at:
            workers[report.worker] = report
            self._sent[report.backend] = 0  # its in-flight count holds what reached it of those
        if previous is None and len(workers) > MAX_WORKERS:  # a new name: forget reports nothing reads any more,
            horizon = now - self._settings.max_ejection_s - self._settings.health_stale_s  # (past any ejection term)
            for worker in [w for w, r in workers.items() if r.at < horizon]:
                del workers[worker]
            while len(workers) > MAX_WORKERS:  # then the oldest: restarts mint a name each (stage:host:pid)
                del workers[min(workers, key=lambda w: workers[w].at)]

    def member(self, backend: str, now: float) -> Member:
        s = self._settings
        reports = [r for r in self._reports.get(backend, {}).values()]
        fresh = [r for r in reports if now - r.at <= s.health_stale_s]
        # Ejection counts from any report, fresh or not: a worker that reported a failure streak and then
        # went quiet (it has nothing to run while ejected) keeps its backend ejected for the whole term.
        ejected = any(
            r.streak >= s.eject_after and now < r.streak_at + s.term_s(r.ejections)
            for r in reports
        )
        if not fresh:  # reports, all stale: silent (a dead worker's last word was often "idle"); none: unknown
            return Member(0.0, ejected, 0.0, False, silent=bool(reports))
        capacity = sum(max(r.capacity, 1) for r in fresh)
        return Member(
            load=(sum(r.in_flight for r in fresh) + self._sent.get(backend, 0)) / capacity,
            ejected=ejected,
            ttft_p95_ms=max(r.ttft_p95_ms for r in fresh),
            known=True,
            unit=1.0 / capacity,
        )

"""A logging filter that caps repeated log lines, so a broker outage or a stream of poison messages costs
a few lines per window instead of thousands per second, and says how many it dropped."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[str, int, str]  # logger name, level, message template (not the formatted message)


@dataclass
class _Window:
    start: float  # clock time of the window's first record
    passed: int = 0  # records let through in this window
    suppressed: int = 0  # records dropped in this window, reported by the next window's first record


class RateLimit(logging.Filter):
    """Lets at most `burst` records per (logger, level, template) through in each `per_s`-second window.

    Records past that are dropped and counted; the first record of that key once its window has passed
    gets " (N similar lines suppressed)" appended. A key's window starts at its first record. At most
    `max_keys` keys are tracked (templates built with f-strings are all distinct): past that the key whose
    window started first is forgotten, with its count. `clock` is injected for tests.

    Attach one instance per handler. The key and the note ride on the record, so a record that passes
    several handlers is keyed by its original template everywhere and gets the note once.
    """

    def __init__(
        self, per_s: float = 5.0, burst: int = 5, *, clock: Callable[[], float] = time.monotonic, max_keys: int = 1024
    ) -> None:
        if per_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("RateLimit needs per_s > 0, burst >= 1 and max_keys >= 1")
        super().__init__()
        self.per_s = per_s
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._windows: dict[Key, _Window] = {}  # in order of window start: the first is the oldest
        self._lock = threading.Lock()  # handlers filter outside their own lock

    def filter(self, record: logging.LogRecord) -> bool:
        key: Key = record.__dict__.setdefault("rate_limit_key", _key(record))
        with self._lock:
            now = self._clock()
            window = self._windows.get(key)
            reported = 0
            if window is None or now - window.start >= self.per_s:
                reported = window.suppressed if window is not None else 0
                self._windows.pop(key, None)  # re-inserted last: the dict stays ordered by window start
                if len(self._windows) >= self.max_keys:
                    del self._windows[next(iter(self._windows))]
                window = self._windows[key] = _Window(now)
            if window.passed >= self.burst:
                window.suppressed += 1
                return False
            window.passed += 1
        if reported and not getattr(record, "rate_limit_noted", False):
            record.msg = f"{record.msg} ({reported} similar lines suppressed)"
            record.rate_limit_noted = True
        return True


def _key(record: logging.LogRecord) -> Key:
    # `log.error(exc)` passes an object, not a template: its type stands for the template.
    template = record.msg if isinstance(record.msg, str) else type(record.msg).__qualname__
    return (record.name, record.levelno, template)

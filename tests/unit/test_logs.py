"""`logs.RateLimit`: at most `burst` lines per (logger, level, template) per window, then a count."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pipeline.logs import RateLimit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("sluice.test.logs")
    logger.propagate, logger.level = False, logging.DEBUG
    yield logger
    logger.handlers.clear()


def _attach(logger: logging.Logger, limit: RateLimit) -> Collect:
    handler = Collect()
    handler.addFilter(limit)
    logger.addHandler(handler)
    return handler


def test_lets_a_burst_through_then_reports_what_it_dropped(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=5.0, burst=3, clock=clock))
    for i in range(10):
        logger.error("broker down: %s", i)
    assert out.lines == ["broker down: 0", "broker down: 1", "broker down: 2"]
    clock.now += 4.9
    logger.error("broker down: %s", 10)
    assert len(out.lines) == 3  # still the same window
    clock.now += 0.1
    for i in range(11, 13):
        logger.error("broker down: %s", i)
    assert out.lines[3:] == ["broker down: 11 (8 similar lines suppressed)", "broker down: 12"]


def test_no_note_when_nothing_was_dropped(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=1.0, burst=2, clock=clock))
    logger.warning("one")
    clock.now += 1.0
    logger.warning("two")
    assert out.lines == ["one", "two"]


def test_counts_each_logger_level_and_template_apart(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=5.0, burst=1, clock=clock))
    other = logging.getLogger("sluice.test.logs.other")
    other.addHandler(out)  # the same handler and filter under a second logger name
    other.propagate = False
    try:
        for _ in range(3):
            logger.error("a %s", 1)
            logger.warning("a %s", 1)
            logger.error("b %s", 1)
            other.error("a %s", 1)
    finally:
        other.handlers.clear()
    assert out.lines == ["a 1", "a 1", "b 1", "a 1"]


def test_the_template_is_the_key_not_the_formatted_line(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=5.0, burst=2, clock=clock))
    for rid in ("r1", "r2", "r3", "r4"):
        logger.error("request %s failed", rid)
    assert out.lines == ["request r1 failed", "request r2 failed"]


def test_an_object_as_message_is_keyed_by_its_type(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=5.0, burst=1, clock=clock))
    for i in range(3):
        logger.error(ValueError(f"bad {i}"))
    clock.now += 5.0
    logger.error(ValueError("bad 3"))
    assert out.lines == ["bad 0", "bad 3 (2 similar lines suppressed)"]


def test_two_handlers_key_the_record_alike_and_note_it_once(logger: logging.Logger, clock: Clock) -> None:
    first = _attach(logger, RateLimit(per_s=5.0, burst=1, clock=clock))
    second = _attach(logger, RateLimit(per_s=5.0, burst=1, clock=clock))
    logger.error("x %s", 1)
    logger.error("x %s", 2)
    clock.now += 5.0
    logger.error("x %s", 3)
    assert first.lines == second.lines == ["x 1", "x 3 (1 similar lines suppressed)"]


def test_forgets_the_oldest_key_past_max_keys(logger: logging.Logger, clock: Clock) -> None:
    out = _attach(logger, RateLimit(per_s=5.0, burst=1, clock=clock, max_keys=2))
    logger.error("a")
    logger.error("a")  # dropped, then forgotten with its key
    logger.error("b")
    logger.error("c")  # evicts "a"
    logger.error("a")  # a new window: passes, with no count to report
    assert out.lines == ["a", "b", "c", "a"]
    assert len(out.filters[0]._windows) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("kwargs", [{"per_s": 0.0}, {"burst": 0}, {"max_keys": 0}])
def test_refuses_limits_that_would_drop_everything(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RateLimit(**kwargs)  # type: ignore[arg-type]


def test_configure_logging_rate_limits_every_root_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """And pins the loggers that write payloads or URLs at WARNING: httpx logged each upstream request's
    full URL at INFO, `https://user:pw@host/v1?key=...` included."""
    from pipeline.gateway.redact import RedactKeys
    from pipeline.serve import configure_logging

    handler = logging.NullHandler()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])  # basicConfig leaves a root with handlers alone
    levels = {name: logging.getLogger(name).level for name in ("aiokafka", "kafka", "httpx", "httpcore")}
    try:
        configure_logging("DEBUG")
        assert {logging.getLogger(name).level for name in levels} == {logging.WARNING}
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    assert [type(f) for f in handler.filters] == [RateLimit, RedactKeys]


def test_the_bridges_uvicorn_logs_through_the_root_handlers_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's default logging config gave `uvicorn.error` a handler of its own that does not propagate:
    a traceback the bridge logged ("Exception in ASGI application") skipped key redaction and the rate
    limit. The bridge's config keeps uvicorn's loggers on the root handlers."""
    from pipeline.bridge import server_config
    from pipeline.serve import configure_logging
    from pipeline.settings import Settings

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    uvicorn_loggers = {name: logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    saved = {name: (lg.handlers[:], lg.propagate, lg.level) for name, lg in uvicorn_loggers.items()}
    try:
        for lg in uvicorn_loggers.values():  # as in a fresh process (another test may have configured uvicorn)
            lg.handlers, lg.propagate = [], True
        configure_logging("INFO")
        server_config(Settings(), app=object())  # uvicorn configures logging when its Config is made
        for _ in range(40):
            logging.getLogger("uvicorn.error").error("Exception in ASGI application: sk-sluice-%s", "A" * 32)
    finally:
        for name, (handlers, propagate, level) in saved.items():
            lg = uvicorn_loggers[name]
            lg.handlers, lg.propagate = handlers, propagate
            lg.setLevel(level)
    assert lines, "uvicorn's records never reached the root handlers"
    assert not any("A" * 32 in line for line in lines)
    assert len(lines) < 40  # the rate limit's burst, then a note of what it dropped

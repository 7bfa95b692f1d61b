"""`sluice run`'s supervisor stops its children on a signal within one grace period for all of them
(a child still loading its models may not answer SIGTERM at once; make's stop waits for all of this),
and does not start a bridge in every process on a port something already listens on, nor any child when
the topics cannot be created (at once when the broker refuses them, after the attempts otherwise)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
from aiokafka.errors import (
    InvalidConfigurationError,
    KafkaConnectionError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
)

from pipeline import supervisor
from pipeline.settings import Settings
from pipeline.supervisor import Child, Supervisor

DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def test_children_that_ignore_sigterm_are_killed_after_one_shared_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.5)
    children = [Child(f"deaf-{i}", [sys.executable, "-c", DEAF]) for i in range(3)]
    boss = Supervisor(children)
    monkeypatch.setattr(supervisor.signal, "signal", lambda *_: None)  # the test's own process keeps its handlers
    threading.Timer(1.0, boss.stop).start()
    started = time.monotonic()
    assert boss.run() == 0
    took = time.monotonic() - started
    assert all(c.process is not None and c.process.poll() is not None for c in children)  # none left behind
    assert took < 1.0 + 1.5 + 1.0  # one grace period in all (three, one per child, would be 4.5 s)


def test_a_taken_bridge_port_stops_sluice_run_before_it_shares_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its processes bind with SO_REUSEPORT, which another listener of the same user would not refuse."""
    from pipeline.settings import BridgeSettings, RunSettings

    started: list[object] = []
    monkeypatch.setattr(supervisor, "Supervisor", lambda children: started.append(children))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(bridge=BridgeSettings(port=port), run=RunSettings(processes=2))
        assert supervisor.run_supervised(settings) == 1
    assert started == []


def test_a_child_that_cannot_be_started_is_retried_and_leaves_no_other_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(supervisor.signal, "signal", lambda *_: None)
    alive = Child("alive", [sys.executable, "-c", "import time; time.sleep(60)"])
    missing = Child("missing", ["/nonexistent/sluice-child"])  # Popen raises, as with ENOMEM or EAGAIN
    boss = Supervisor([alive, missing])
    threading.Timer(1.0, boss.stop).start()
    assert boss.run() == 0  # it raised FileNotFoundError out of run(), the first child still running
    assert alive.process is not None and alive.process.poll() is not None
    assert missing.process is None and missing.due > 0


def test_a_failure_while_tending_stops_every_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(supervisor.signal, "signal", lambda *_: None)
    alive = Child("alive", [sys.executable, "-c", "import time; time.sleep(60)"])
    boss = Supervisor([alive])
    tend = boss._tend
    calls = []

    def failing(child: Child, now: float) -> None:
        calls.append(now)
        if len(calls) > 3:
            raise RuntimeError("a bug in the supervisor")
        tend(child, now)

    monkeypatch.setattr(boss, "_tend", failing)
    with pytest.raises(RuntimeError):
        boss.run()
    assert alive.process is not None and alive.process.poll() is not None  # not orphaned


@pytest.mark.parametrize("failure", [TopicAuthorizationFailedError("creating topic llm.requests: Authorization failed."),
                                     InvalidConfigurationError("creating topic llm.requests: bad retention.ms")])
def test_a_refusal_to_create_the_topics_stops_sluice_run_at_once_with_its_text(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: Exception) -> None:
    calls, started = _topics_failing(monkeypatch, [failure])
    assert supervisor.run_supervised(Settings()) == 1
    assert len(calls) == 1 and started == []  # not retried, no child started
    assert str(failure) in caplog.text


def test_topics_are_retried_while_the_broker_starts_and_children_start_after(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, started = _topics_failing(monkeypatch, [KafkaConnectionError("Unable to bootstrap"), KafkaTimeoutError(), TimeoutError()])
    assert supervisor.run_supervised(Settings()) == 0
    assert len(calls) == 4 and len(started) == 1


def test_no_child_starts_when_the_attempts_to_create_the_topics_run_out(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(supervisor, "TOPIC_ATTEMPTS", 3)
    calls, started = _topics_failing(monkeypatch, [KafkaConnectionError("Unable to bootstrap")] * 5)
    assert supervisor.run_supervised(Settings()) == 1
    assert len(calls) == 3 and started == []
    assert "failed 3 times" in caplog.text and "Unable to bootstrap" in caplog.text


def _topics_failing(monkeypatch: pytest.MonkeyPatch, failures: list[Exception]) -> tuple[list[object], list[object]]:
    """kafka.create_topics raising `failures` in turn, then succeeding; no sleeping; children not started."""
    from pipeline import kafka

    calls: list[object] = []
    started: list[object] = []

    async def create_topics(settings: Settings) -> list[str]:
        calls.append(settings)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return []

    monkeypatch.setattr(kafka, "create_topics", create_topics)
    monkeypatch.setattr(supervisor.time, "sleep", lambda _: None)

    class Boss:
        def __init__(self, children: list[Child]) -> None:
            started.append(children)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", Boss)
    monkeypatch.setattr(supervisor, "processes_for", lambda settings, requested=None: 1)
    return calls, started

"""Keeps child processes alive: `sluice run` runs the pipeline in children and starts each again when it
exits non-zero (a stage that truly cannot continue exits; it does not limp on).

`run_supervised` spreads the pipeline over N processes (one per core by default), each running every
stage and a bridge on the one port (`[run] bridges = "every"`; "first": the bridge in the first only);
each stage's consumer group shares its partitions among them, so N may usefully reach the topics'
partition count.

The topics are created before any child starts, tried again while the broker may still be starting; a
refusal (not authorised, an invalid config) or the last attempt failing ends `sluice run` with exit 1,
its error logged, and no child started.

Restarts back off exponentially (1 s doubling to 30 s) and the backoff resets once a child has stayed
up for a minute. SIGINT/SIGTERM are passed on to the children, which shut down gracefully; a clean
exit (0) is not restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.settings import Settings

log = logging.getLogger(__name__)

HEALTHY_S = 60.0
STOP_GRACE_S = 30.0  # after SIGINT/SIGTERM, children still running after this are killed
MAX_BACKOFF_S = 30.0
TOPIC_ATTEMPTS = 60  # creating the topics, while the broker may still be starting (1 s, 2 s, ... then 5 s apart)


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = 1.0
    restarts: int = 0
    due: float = field(default=0.0)  # when to start it (again)
    env: dict[str, str] | None = None  # its environment (None: this process's)


class Supervisor:
    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self._stopping = False

    def stop(self, *_: object) -> None:
        self._stopping = True
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Until a signal: start children that are due, restart those that died. Returns the exit code."""
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)
        try:
            while not self._stopping:
                now = time.monotonic()
                for child in list(self.children):
                    self._tend(child, now)
                time.sleep(0.2)
        finally:  # also when tending raised: no child outlives its supervisor
            self.stop()
            self._reap()
        return 0

    def _reap(self) -> None:
        deadline = time.monotonic() + STOP_GRACE_S  # one grace period for all children, not one each
        for child in self.children:
            if child.process is not None:
                try:
                    child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()

    def _tend(self, child: Child, now: float) -> None:
        if child.process is None:
            if now >= child.due and not self._stopping:  # a signal may have come while the others were tended
                try:
                    child.process = subprocess.Popen(list(child.argv), env=child.env)
                except OSError as exc:  # out of memory or processes for a moment: a failed start, tried again
                    child.due = now + child.backoff
                    log.error("%s could not be started (%s); retrying in %.0f s", child.name, exc.strerror, child.backoff)
                    child.backoff = min(child.backoff * 2, MAX_BACKOFF_S)
                    return
                child.started = now
                log.info("started %s (pid %d)", child.name, child.process.pid)
            return
        code = child.process.poll()
        if code is None:
            if now - child.started > HEALTHY_S:
                child.backoff = 1.0
            return
        child.process = None
        if code == 0:
            log.info("%s exited cleanly; not restarting", child.name)
            self.children.remove(child)
            if not self.children:
                self._stopping = True
            return
        child.restarts += 1
        child.due = now + child.backoff
        log.error("%s exited with %d; restart %d in %.0f s", child.name, code, child.restarts, child.backoff)
        child.backoff = min(child.backoff * 2, MAX_BACKOFF_S)


def processes_for(settings: Settings, requested: int | None = None) -> int:
    """How many processes `sluice run` uses: asked for, else `[run] processes`, else one per core."""
    wanted = requested if requested is not None else settings.run.processes
    return wanted if wanted > 0 else (os.cpu_count() or 1)


def run_supervised(settings: Settings, requested: int | None = None) -> int:
    """`sluice run`: the topics first (stage processes subscribe to them), then the processes."""
    from pipeline.serve import configure_logging

    configure_logging()
    n = processes_for(settings, requested)
    shared = settings.run.bridges == "every" and n > 1
    if shared and (taken := _port_taken(settings.bridge.host, settings.bridge.port)) is not None:
        # Checked first because the processes bind with SO_REUSEPORT, which would share the port with
        # another `sluice run` of this user instead of failing.
        log.error("the bridge's address %s:%d is taken (%s); is sluice already running?", settings.bridge.host, settings.bridge.port, taken)
        return 1
    if not _topics_created(settings):
        return 1
    command = [sys.executable, "-m", "pipeline.cli"]
    run_dir = None
    if shared:
        run_dir = tempfile.mkdtemp(prefix="sluice-run-")  # mode 700: each process's metrics socket (observability/siblings.py)
        children = [Child(f"sluice-{i}", [*command, "run", "--in-process", "--shared-port"],
                          env={**os.environ, "SLUICE_RUN_DIR": run_dir, "SLUICE_PROCESS": str(i)}) for i in range(n)]
    else:
        children = [Child("sluice", [*command, "run", "--in-process"])]
        base = settings.observability.metrics_port  # stage processes serve /metrics on base, base + 1, ... (the first: the bridge)
        children += [Child(f"stages-{i}", [*command, "worker"], env={**os.environ, "SLUICE_METRICS_PORT": str(base + i - 1)} if base else None)
                     for i in range(1, n)]
    log.info("sluice run: %d process%s", n, "es" if n > 1 else "")
    try:
        return Supervisor(children).run()
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _topics_created(settings: Settings) -> bool:
    """Creates the topics, trying again while the broker may still be starting (a retriable error or a
    timeout: about 5 minutes in all); False, with the error logged, when it refuses for good (not
    authorised, an invalid config) or the attempts run out. Any other exception is a bug and propagates."""
    from aiokafka.errors import KafkaError, KafkaTimeoutError

    from pipeline import kafka

    attempts = TOPIC_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            asyncio.run(kafka.create_topics(settings))
            return True
        except (KafkaError, TimeoutError, OSError) as exc:  # an admin client's error: no request data in it
            error = str(exc) if type(exc).__name__ in str(exc) else f"{type(exc).__name__}: {exc}"
            # aiokafka marks a KafkaTimeoutError not retriable, but a broker still starting is what it means here
            if isinstance(exc, KafkaError) and not exc.retriable and not isinstance(exc, KafkaTimeoutError):
                log.error("creating topics failed: %s; not starting the pipeline", error)
                return False
            if attempt == attempts:
                log.error("creating topics failed %d times, the last: %s; not starting the pipeline", attempts, error)
                return False
            log.warning("creating topics failed (%s); attempt %d of %d, retrying", error, attempt, attempts)
            time.sleep(min(float(attempt), 5.0))
    return False


def _port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be bound by a plain socket (None: it can)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None

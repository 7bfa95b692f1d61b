"""Keeps child processes alive: `sluice run` runs the pipeline in a child and starts it again when it
exits non-zero (a stage that truly cannot continue exits; it does not limp on).

Restarts back off exponentially (1 s doubling to 30 s) and the backoff resets once a child has stayed
up for a minute. SIGINT/SIGTERM are passed on to the children, which shut down gracefully; a clean
exit (0) is not restarted.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEALTHY_S = 60.0
MAX_BACKOFF_S = 30.0


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = 1.0
    restarts: int = 0
    due: float = field(default=0.0)  # when to start it (again)


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
        while not self._stopping:
            now = time.monotonic()
            for child in list(self.children):
                self._tend(child, now)
            time.sleep(0.2)
        for child in self.children:
            if child.process is not None:
                try:
                    child.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.process.kill()
        return 0

    def _tend(self, child: Child, now: float) -> None:
        if child.process is None:
            if now >= child.due:
                child.process = subprocess.Popen(list(child.argv))
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

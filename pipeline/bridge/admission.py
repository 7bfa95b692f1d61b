"""Admission control: how many requests one bridge process holds open at once.

Past the pipeline's knee every request waits longer than the one before it, and without a bound a
bridge keeps accepting until every answer is late (docs/benchmarks.md measured goodput falling to half
the knee at twice the knee's rate). With `bridge.max_in_flight` set, a request over the bound is
answered at once with 503 and `Retry-After`, before it reaches Kafka, so the requests that are admitted
keep their latency and a client (or a load balancer in front of several bridges) tries again or
elsewhere. It counts HTTP requests until their response ends and WebSocket requests until their
terminal message; the refusals are `sluice_messages_total{stage="bridge",outcome="overloaded"}`.

A place is taken only once the caller has passed the bridge's own credential check and its request is
read whole (an HTTP body, bounded by size and `bridge.body_timeout_s`; a WebSocket message arrives
whole): a caller without a valid-looking credential, or one that uploads slowly, holds no place that a
valid caller needs. An HTTP request is still refused before its body is read when no place is free then.
"""

from __future__ import annotations

from pipeline.bridge.openai_format import BridgeError
from pipeline.metrics import MESSAGES
from topics.errors import ErrorCode

RETRY_AFTER_S = 1


class Overloaded(BridgeError):
    status = 503
    code = ErrorCode.unavailable
    headers = {"retry-after": str(RETRY_AFTER_S)}


class Admission:
    """A counter with a bound (`limit` 0: no bound). Not a semaphore: nobody waits for a place."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def check(self) -> None:
        """Raises `Overloaded` if no place is free now, without taking one: a request is refused before
        its body is read, and takes its place (`enter`) only once the body is in."""
        if self.limit and self.open >= self.limit:
            MESSAGES.labels("bridge", "overloaded").inc()
            raise Overloaded(f"this bridge has {self.open} requests open, its limit; retry in {RETRY_AFTER_S} s")

    def enter(self) -> None:
        """Takes a place, or raises `Overloaded`; every `enter` that returns is paired with one `leave`."""
        self.check()
        self.open += 1

    def leave(self) -> None:
        self.open -= 1

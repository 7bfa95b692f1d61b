"""Replies handed to a reader of the same process as soon as the broker has them.

The bridge's client (`pipeline.sdk.Client`) reads its reply topic like any consumer. When emit runs in
the same process (`sluice run`'s first process, the embedded demo), each reply it produces is also
handed to that client once the broker has acknowledged it: a consumer's fetch sooner, about half of
the last crossing. The copy the client then reads from the topic is dropped as a duplicate (a chunk by
its seq, a terminal event because its request has ended). Only acknowledged records are handed over,
so the topic stays the truth: whatever a client got this way is on it for every other reader, and a
crash loses nothing the topic would have kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reader = Callable[[Any], None]

_readers: dict[str, list[Reader]] = {}


def listen(topic: str, reader: Reader) -> Callable[[], None]:
    """Hands `reader` every record produced to `topic` in this process once acknowledged; returns the
    call that stops it."""
    _readers.setdefault(topic, []).append(reader)

    def stop() -> None:
        readers = _readers.get(topic, [])
        if reader in readers:
            readers.remove(reader)
        if not readers:
            _readers.pop(topic, None)

    return stop


def readers(topic: str) -> list[Reader] | None:
    return _readers.get(topic)

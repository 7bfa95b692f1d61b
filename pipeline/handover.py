"""Handover (`runtime.handover`): what `pipeline.handling` needs to pass a stage's output to another stage
of the same process in memory instead of through the broker: where a handed message came from (for a dead
letter), which stages take consecutive messages of a request together, and the in-process reader of
reply topics (the bridge's SDK client) that emit can hand a reply to. `pipeline.handling`'s docstring
says when a message is handed over."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.stage import Out, Resettable, Stage
from topics import codec


class LocalReplies(Protocol):
    """A reader of reply topics in this process (the bridge's SDK client, `pipeline.sdk.Client`)."""

    def take_reply(self, topic: str, event: Any) -> bool: ...

    def send_requests_to(self, partitions: Callable[[], Sequence[int]]) -> None: ...


@dataclass(frozen=True)
class Handed:
    """Where a handed-over message came from, in the shape a dead letter describes a record by."""

    out: Out
    partition: int = -1  # it never reached a partition
    offset: int = -1

    @property
    def topic(self) -> str:
        return self.out.topic

    @property
    def value(self) -> bytes:
        return codec.encode(self.out.value)


def takes_groups(stage: Stage) -> bool:
    """An ordered stage that says so (`groups`: emit) and can forget what it cached (`Resettable`) takes
    consecutive messages of one request together (`Handling.process_group`, `Handling.take_group`)."""
    return stage.ordered and getattr(stage, "groups", False) and isinstance(stage, Resettable)

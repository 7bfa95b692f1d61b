"""A Kafka client whose start fails or is cancelled is stopped before the error goes on, so none of the
connections it opened is left to the garbage collector (an unclosed socket, seen at the end of a test run);
a topic the broker refuses to create raises its error."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError, TopicAuthorizationFailedError

from pipeline import kafka
from pipeline.settings import Settings


class Client:
    def __init__(self, failure: BaseException) -> None:
        self.failure = failure
        self.stopped = False

    def subscribe(self, topics: list[str], listener: object) -> None:
        pass

    async def start(self) -> None:
        raise self.failure

    async def stop(self) -> None:
        self.stopped = True

    async def close(self) -> None:
        self.stopped = True


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", [asyncio.CancelledError(), OSError("refused"), KafkaConnectionError()])
async def test_a_start_cut_short_stops_the_client(failure: BaseException) -> None:
    made: list[Client] = []
    stop = asyncio.Event()
    stop.set()  # no retry: the first failure is raised

    def make() -> Client:
        made.append(Client(failure))
        return made[-1]

    with pytest.raises(type(failure)):
        await kafka.started(make, stop, "test")
    assert len(made) == 1 and made[0].stopped


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", [asyncio.CancelledError(), KafkaConnectionError()])
async def test_a_broadcast_consumer_or_admin_whose_start_fails_is_stopped(monkeypatch: pytest.MonkeyPatch, failure: BaseException) -> None:
    made: list[Client] = []

    def client(*args: object, **kwargs: object) -> Client:
        made.append(Client(failure))
        return made[-1]

    monkeypatch.setattr(kafka, "AIOKafkaConsumer", client)
    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", client)
    with pytest.raises(type(failure)):
        await kafka.broadcast_consumer(Settings(), ("t",), "test")
    with pytest.raises(type(failure)):
        await kafka.create_topics(Settings())
    assert len(made) == 2 and all(c.stopped for c in made)


class Admin:
    """An admin client whose CreateTopics response carries `errors` (topic, code, message) for every topic."""

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, message
        self.closed = False

    async def start(self) -> None:
        pass

    async def list_topics(self) -> list[str]:
        return []

    async def find_coordinator(self, group: str) -> int:
        return 1

    async def create_topics(self, new: list[object]) -> object:
        return type("Response", (), {"topic_errors": [(t.name, self.code, self.message) for t in new]})()  # type: ignore[attr-defined]

    async def close(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_a_topic_the_broker_refuses_raises_its_error_and_one_that_exists_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiokafka returns CreateTopics errors in the response instead of raising them."""
    refused = Admin(TopicAuthorizationFailedError.errno, "Authorization failed.")
    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", lambda *args, **kwargs: refused)
    with pytest.raises(TopicAuthorizationFailedError, match="Authorization failed"):
        await kafka.create_topics(Settings())
    assert refused.closed
    existing = Admin(TopicAlreadyExistsError.errno, "exists")
    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", lambda *args, **kwargs: existing)
    assert await kafka.create_topics(Settings())  # created concurrently: the names, no error

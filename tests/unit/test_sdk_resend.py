"""The SDK sends a request again, the same bytes to the same partition, when an outage explains the
failure, until the request's deadline; any other failure reaches the caller at once."""

from __future__ import annotations

import time

import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    LeaderNotAvailableError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
)

from pipeline import sdk
from pipeline.sdk import Client
from tests.unit.helpers import SETTINGS


class Refusing:
    """A producer whose first sends fail with `failures`, in turn; the sends are recorded."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.sent: list[tuple[str, bytes, bytes, int | None]] = []

    async def send_and_wait(self, topic: str, value: bytes, *, key: bytes, headers: object = None,
                            partition: int | None = None) -> None:
        self.sent.append((topic, value, key, partition))
        if self.failures:
            raise self.failures.pop(0)


def client_with(producer: Refusing, monkeypatch: pytest.MonkeyPatch) -> Client:
    monkeypatch.setattr(sdk, "RESEND_AFTER_S", 0.01)
    client = Client(SETTINGS)
    client._producer = producer  # type: ignore[assignment]
    client.send_requests_to(lambda: [3, 4])
    return client


@pytest.mark.asyncio
async def test_a_request_the_broker_did_not_take_in_an_outage_is_sent_again_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Refusing(LeaderNotAvailableError(), KafkaTimeoutError(), OutOfOrderSequenceNumber())
    client = client_with(producer, monkeypatch)
    await client._produce(client.request(prompt="hi", deadline_s=30))
    assert len(producer.sent) == 4 and len(set(producer.sent)) == 1  # same topic, bytes, key, partition
    assert producer.sent[0][3] == 3


@pytest.mark.asyncio
async def test_a_failure_no_outage_explains_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Refusing(MessageSizeTooLargeError())
    client = client_with(producer, monkeypatch)
    with pytest.raises(MessageSizeTooLargeError):
        await client._produce(client.request(prompt="hi", deadline_s=30))
    assert len(producer.sent) == 1


@pytest.mark.asyncio
async def test_sending_again_stops_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Refusing(*[LeaderNotAvailableError() for _ in range(1000)])
    client = client_with(producer, monkeypatch)
    started = time.monotonic()
    with pytest.raises(LeaderNotAvailableError):
        await client._produce(client.request(prompt="hi", deadline_s=0.2))
    assert time.monotonic() - started < 1.0 and 2 <= len(producer.sent) < 1000


@pytest.mark.asyncio
async def test_a_request_never_taken_is_not_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its cancel would wait out the same outage, for nothing: the caller hears the failure at once."""
    client = client_with(Refusing(MessageSizeTooLargeError()), monkeypatch)
    cancelled: list[str] = []

    async def cancel(request_id: str, reason: object = None) -> None:
        cancelled.append(request_id)

    client.cancel = cancel  # type: ignore[method-assign]
    with pytest.raises(MessageSizeTooLargeError):
        async for _ in client.stream(prompt="hi", deadline_s=30):
            pass
    assert cancelled == []

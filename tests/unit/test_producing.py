"""The runner's producer is replaced once the broker refuses its producer id (after a long outage)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaTimeoutError, OutOfOrderSequenceNumber

from pipeline.producing import Producer
from pipeline.settings import Settings


class FakeClient:
    def __init__(self, outcome: BaseException | None) -> None:
        self.outcome = outcome
        self.stopped = False

    async def send(self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]],
                   partition: int | None = None) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.outcome is None:
            ack.set_result(None)
        else:
            ack.set_exception(self.outcome)
        return ack

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.asyncio
@pytest.mark.parametrize(("failure", "renewed"), [(OutOfOrderSequenceNumber(), True), (KafkaTimeoutError(), False)])
async def test_a_refused_producer_id_makes_the_next_send_use_a_new_client(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException, renewed: bool
) -> None:
    fresh = FakeClient(None)

    async def started(*args: object, **kwargs: object) -> FakeClient:
        return fresh

    monkeypatch.setattr("pipeline.producing.kafka.started", started)
    producer = Producer(Settings(), "test")
    broken = FakeClient(failure)
    producer._client = broken  # type: ignore[assignment]
    ack = await producer.send("t", b"v", key=b"k", headers=[])
    with pytest.raises(type(failure)):
        await ack
    await asyncio.sleep(0)  # the outcome's callbacks run
    await producer.send("t", b"v", key=b"k", headers=[])
    assert (producer._client is fresh) is renewed and broken.stopped is renewed and producer.renewals == int(renewed)

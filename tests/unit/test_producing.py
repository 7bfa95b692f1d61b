"""The runner's producer is replaced once the broker refuses its producer id (after a long outage), and
sends records nobody waits for through a client of its own that lingers to batch them."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import (
    LeaderNotAvailableError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
)

from pipeline.producing import Producer
from pipeline.settings import KafkaSettings, Settings
from topics import registry


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
@pytest.mark.parametrize(("failure", "renewed"), [
    (OutOfOrderSequenceNumber(), True),
    (LeaderNotAvailableError(), True),  # expired for want of a leader: its sequence numbers are spent
    (MessageSizeTooLargeError(), True),  # refused by the broker: spent too
    (RuntimeError(), False),  # not the broker's answer
])
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
    await asyncio.sleep(0)  # the old client is stopped in the background
    assert (producer._client is fresh) is renewed and broken.stopped is renewed and producer.renewals == int(renewed)


class Flushing(FakeClient):
    """A client whose stop waits for its pending batches, as aiokafka's does (up to 30 s in an outage)."""

    def __init__(self) -> None:
        super().__init__(OutOfOrderSequenceNumber())
        self.flushed = asyncio.Event()

    async def stop(self) -> None:
        await self.flushed.wait()
        self.stopped = True


@pytest.mark.asyncio
async def test_the_send_that_renews_does_not_wait_for_the_old_client_to_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = FakeClient(None)

    async def started(*args: object, **kwargs: object) -> FakeClient:
        return fresh

    monkeypatch.setattr("pipeline.producing.kafka.started", started)
    producer = Producer(Settings(), "test")
    old = Flushing()
    producer._client = old  # type: ignore[assignment]
    with pytest.raises(OutOfOrderSequenceNumber):
        await (await producer.send("t", b"v", key=b"k", headers=[]))
    await asyncio.sleep(0)
    ack = await asyncio.wait_for(producer.send("t", b"v", key=b"k", headers=[]), 1.0)  # not after the flush
    assert producer._client is fresh and await ack is None and not old.stopped
    stopping = asyncio.create_task(producer.stop())  # waits for the old client too
    await asyncio.sleep(0.01)
    assert not stopping.done()
    old.flushed.set()
    await stopping
    assert old.stopped and fresh.stopped


@pytest.mark.asyncio
async def test_a_failure_of_a_replaced_client_does_not_renew_its_successor(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Producer(Settings(), "test")
    old, current = FakeClient(OutOfOrderSequenceNumber()), FakeClient(None)
    producer._client = old  # type: ignore[assignment]
    late = await producer.send("t", b"v", key=b"k", headers=[])
    producer._client = current  # type: ignore[assignment]  # renewed meanwhile
    with pytest.raises(OutOfOrderSequenceNumber):
        await late
    await asyncio.sleep(0)
    assert not producer._unusable()


class RecordingClient(FakeClient):
    def __init__(self, linger_ms: int) -> None:
        super().__init__(None)
        self.linger_ms = linger_ms
        self.topics: list[str] = []

    async def send(self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]],
                   partition: int | None = None) -> asyncio.Future[None]:
        self.topics.append(topic)
        return await super().send(topic, value, key, headers, partition)


async def started_clients(monkeypatch: pytest.MonkeyPatch, settings: Settings, **kwargs: object) -> tuple[Producer, list[RecordingClient]]:
    """A started Producer whose clients record their linger and what was sent through them."""
    clients: list[RecordingClient] = []

    async def started(make: object, stop: object, name: str) -> RecordingClient:
        clients.append(RecordingClient(make().linger_ms))  # type: ignore[operator]
        return clients[-1]

    monkeypatch.setattr("pipeline.producing.kafka.started", started)
    monkeypatch.setattr("pipeline.producing.kafka.producer", lambda settings, client_id, linger_ms: type("P", (), {"linger_ms": linger_ms})())
    producer = Producer(settings, "test", **kwargs)  # type: ignore[arg-type]
    await producer.start(asyncio.Event())
    return producer, clients


@pytest.mark.asyncio
async def test_records_nobody_waits_for_go_through_a_lingering_client(monkeypatch: pytest.MonkeyPatch) -> None:
    producer, clients = await started_clients(monkeypatch, Settings(), lingering=registry.LINGERING)
    for topic in (registry.REQUESTS, registry.USAGE, registry.CACHE_ENTRIES, registry.HEALTH, "llm.responses.bridge"):
        await (await producer.send(topic, b"v", key=b"k", headers=[]))
    main, lingering = clients
    assert (main.linger_ms, lingering.linger_ms) == (Settings().kafka.linger_ms, Settings().kafka.lingering_ms)
    assert main.topics == [registry.REQUESTS, registry.HEALTH, "llm.responses.bridge"]
    assert lingering.topics == [registry.USAGE, registry.CACHE_ENTRIES]
    await producer.stop()
    assert main.stopped and lingering.stopped


@pytest.mark.asyncio
@pytest.mark.parametrize("kwargs", [{}, {"lingering": registry.LINGERING, "lingering_ms": 0}])
async def test_one_client_without_lingering_topics_or_linger(monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object]) -> None:
    settings = Settings(kafka=KafkaSettings(lingering_ms=kwargs.get("lingering_ms", 20)))  # type: ignore[arg-type]
    producer, clients = await started_clients(monkeypatch, settings, **{k: v for k, v in kwargs.items() if k != "lingering_ms"})
    await (await producer.send(registry.USAGE, b"v", key=b"k", headers=[]))
    assert len(clients) == 1 and clients[0].topics == [registry.USAGE]


class SenderStopping(FakeClient):
    """As aiokafka's client: once stopped, its sender task is done (which `_unusable` reads as dead)."""

    def __init__(self) -> None:
        super().__init__(None)
        self._sender = type("Sender", (), {"sender_task": asyncio.get_running_loop().create_future()})()

    async def stop(self) -> None:
        await super().stop()
        self._sender.sender_task.set_result(None)


@pytest.mark.asyncio
async def test_a_send_after_stop_raises_rather_than_start_a_client_nobody_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[FakeClient] = []

    async def start(*args: object, **kwargs: object) -> FakeClient:
        started.append(FakeClient(None))
        return started[-1]

    monkeypatch.setattr("pipeline.producing.kafka.started", start)
    producer = Producer(Settings(), "test")
    producer._client = SenderStopping()  # type: ignore[assignment]
    await producer.stop()
    with pytest.raises(ProducerClosed):
        await producer.send("t", b"v", key=b"k", headers=[])
    with pytest.raises(ProducerClosed):
        await producer.send_together("t", b"k", [(b"v", [])])
    assert started == [] and producer.renewals == 0

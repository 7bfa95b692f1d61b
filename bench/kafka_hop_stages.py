"""The stages of bench/kafka_hop.py, each run in a process of its own as a sluice worker is:
consume topic A, produce every message to topic B, commit what was acknowledged. `STAGES` names the
variants (library, commit policy, producer idempotence).

    .venv/bin/python -m bench.kafka_hop_stages NAME BOOTSTRAP IN_TOPIC OUT_TOPIC GROUP STATE_DIR   (kafka_hop starts it)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

FETCH_MAX_WAIT_MS = 500  # the value sluice's runner uses (pipeline/kafka.py): a fetch returns as soon as data is there
COMMIT_INTERVAL_S = 0.2  # how often sluice's runner commits acknowledged offsets (pipeline/runner.py)

@dataclass(frozen=True)
class StageSpec:
    library: str  # "aiokafka" or "faust"
    commit_interval_s: float | None  # 0: after every batch; None: the library's default
    idempotent: bool  # the stage's producer; the probe's always is
    label: str


STAGES = {
    "aiokafka": StageSpec("aiokafka", 0.0, True, "aiokafka, commit after each batch's acks"),
    "aiokafka-200ms": StageSpec("aiokafka", COMMIT_INTERVAL_S, True, "aiokafka, commit every 200 ms"),
    "faust": StageSpec("faust", COMMIT_INTERVAL_S, True, "faust agent, idempotent, commit every 200 ms"),
    "faust-defaults": StageSpec("faust", None, False, "faust agent, faust's defaults"),
    "confluent-200ms": StageSpec("confluent", COMMIT_INTERVAL_S, True, "confluent-kafka under asyncio, commit every 200 ms"),
}

def producer(bootstrap: str, client_id: str) -> AIOKafkaProducer:
    """The producer settings of sluice's runner (pipeline/kafka.py)."""
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, client_id=client_id, enable_idempotence=True, acks="all", linger_ms=0
    )


async def aiokafka_stage(bootstrap: str, topic_in: str, topic_out: str, group: str, spec: StageSpec) -> None:
    """Consume A, produce B, await the acks, commit what was acknowledged: sluice's runner loop, no handler."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    consumer = AIOKafkaConsumer(
        topic_in, bootstrap_servers=bootstrap, group_id=group, client_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed", fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
    )
    out = producer(bootstrap, group)
    await out.start()
    await consumer.start()
    acked: dict[TopicPartition, int] = {}
    last_commit = time.monotonic()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=100)
            acks = [await out.send(topic_out, r.value, key=r.key) for records in batch.values() for r in records]
            await asyncio.gather(*acks)
            acked.update({tp: records[-1].offset + 1 for tp, records in batch.items()})
            if acked and time.monotonic() - last_commit >= (spec.commit_interval_s or 0.0):
                await consumer.commit(acked)
                acked, last_commit = {}, time.monotonic()
        if acked:
            await consumer.commit(acked)
    finally:
        await consumer.stop()
        await out.stop()


async def confluent_stage(bootstrap: str, topic_in: str, topic_out: str, group: str, spec: StageSpec) -> None:
    """The aiokafka stage's loop on confluent-kafka: librdkafka fetches and sends on its own threads. One
    thread owns the consumer: it blocks in `consume`, hands each batch to the event loop and commits what
    was acknowledged every 200 ms; the loop produces (a C call that queues); a thread serving delivery
    reports hands each batch's acknowledgement back to the loop. Each crossing is a
    `call_soon_threadsafe`, as a sluice runner on this client would need (its handlers and acks live
    on the loop)."""
    import threading

    from confluent_kafka import Consumer, Producer
    from confluent_kafka import TopicPartition as Partition

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    common = {"bootstrap.servers": bootstrap, "client.id": group}
    consumer = Consumer({**common, "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "isolation.level": "read_committed", "fetch.wait.max.ms": FETCH_MAX_WAIT_MS})
    out = Producer({**common, "enable.idempotence": True, "acks": "all", "linger.ms": 0})
    consumer.subscribe([topic_in])
    batches: asyncio.Queue[list[Any]] = asyncio.Queue()
    acked: dict[tuple[str, int], int] = {}
    lock = threading.Lock()
    running = True

    def commit() -> None:
        with lock:
            offsets = [Partition(t, p, o) for (t, p), o in acked.items()]
            acked.clear()
        if offsets:
            consumer.commit(offsets=offsets, asynchronous=False)

    def consume() -> None:
        last_commit = time.monotonic()
        while running:
            # `consume` waits for its whole batch or its timeout: the first message comes from `poll`,
            # which returns as soon as one is there, and the rest of the batch only from what has arrived
            first = consumer.poll(0.1)
            if first is not None:
                records = [r for r in (first, *consumer.consume(num_messages=499, timeout=0)) if r.error() is None]
                loop.call_soon_threadsafe(batches.put_nowait, records)
            if time.monotonic() - last_commit >= (spec.commit_interval_s or 0.0):
                commit()
                last_commit = time.monotonic()
        commit()
        consumer.close()

    def deliver() -> None:
        while running or len(out):
            out.poll(0.1)

    def acknowledged(last: dict[tuple[str, int], int]) -> None:
        with lock:
            acked.update(last)

    threads = [threading.Thread(target=consume), threading.Thread(target=deliver)]
    for thread in threads:
        thread.start()
    try:
        while not stop.is_set():
            try:
                records = await asyncio.wait_for(batches.get(), 0.1)
            except TimeoutError:
                continue
            last = {(r.topic(), r.partition()): r.offset() + 1 for r in records}
            pending = [len(records), 0]  # reports to come, failures

            def one_delivered(err: Any, _msg: Any, last: dict[tuple[str, int], int] = last, pending: list[int] = pending) -> None:
                pending[0] -= 1  # delivery reports run on the deliver thread, one at a time
                pending[1] += err is not None
                if pending[0] == 0 and not pending[1]:
                    loop.call_soon_threadsafe(acknowledged, last)

            for r in records:
                out.produce(topic_out, r.value(), r.key(), on_delivery=one_delivered)
    finally:
        out.flush(5)
        running = False
        for thread in threads:
            await asyncio.to_thread(thread.join)


def faust_stage(bootstrap: str, topic_in: str, topic_out: str, group: str, state: Path, spec: StageSpec) -> None:
    """A faust agent forwarding A to B, run by faust's own Worker (which handles SIGTERM)."""
    import faust  # imported here: faust-streaming is a bench-only extra (pyproject [bench])
    from faust.transport.drivers.aiokafka import Producer

    class IdempotentProducer(Producer):
        def _settings_extra(self) -> dict[str, Any]:  # faust turns idempotence on only for exactly_once
            return {"acks": "all", "enable_idempotence": True}

    settings: dict[str, Any] = {"broker_commit_interval": spec.commit_interval_s} if spec.commit_interval_s else {}
    app = faust.App(
        group, broker=f"kafka://{bootstrap}", value_serializer="raw", key_serializer="raw", web_enabled=False,
        topic_disable_leader=True, datadir=str(state / "faust-data"), **settings,
    )
    if spec.idempotent:
        app.producer = IdempotentProducer(app.transport, loop=app.loop, beacon=app.beacon)
    source, sink = app.topic(topic_in), app.topic(topic_out)

    @app.agent(source, name="forward")
    async def forward(stream: faust.StreamT[bytes]) -> None:
        async for value in stream:
            await sink.send(value=value)

    @app.task
    async def describe() -> None:  # one line in the stage log, from aiokafka's private fields, to check the setup
        client = app.producer._producer
        print(f"faust producer: {type(app.producer).__name__}, idempotent={client._txn_manager is not None}, "
              f"acks={client._sender._acks}, linger_s={client._message_accumulator._linger_time}, "
              f"commit_interval_s={app.conf.broker_commit_interval}", flush=True)

    faust.Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def main(argv: list[str]) -> None:
    name, bootstrap, topic_in, topic_out, group, state = argv
    spec = STAGES[name]
    if spec.library == "faust":
        faust_stage(bootstrap, topic_in, topic_out, group, Path(state), spec)
    else:
        stage = aiokafka_stage if spec.library == "aiokafka" else confluent_stage
        uvloop.run(stage(bootstrap, topic_in, topic_out, group, spec))  # as `sluice run` does


if __name__ == "__main__":
    main(sys.argv[1:])

"""One Kafka hop after idle gaps: how much slower the broker and the client answer when nothing came
for a while. The floor under every figure that depends on idle time, such as an exact cache hit right
after a miss (bench.cache_latency's rounds and --gaps-ms): sluice's request crosses the broker twice.

    .venv/bin/python -m bench.kafka_idle                          # gaps 0,5,20,100 ms, 3 repeats
    .venv/bin/python -m bench.kafka_idle --gaps-ms 0,50,200 --repeats 5

Starts its own Kafka and Redis (ports 19792/16879). One aiokafka producer (idempotent, `linger_ms = 0`)
and one consumer (`fetch_max_wait_ms = 500`), both as sluice's runner configures them, in this process
on uvloop; a 300-byte message is sent, and the time until the consumer has it is one hop. Each gap runs
--count hops, each after sleeping the gap; the gaps' order is reversed on every other repeat. Reported:
p50 and p90 per gap, median (min..max) over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import uvloop
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.services import own_services
from bench.stats import percentile, spread


async def measure(bootstrap: str, gaps_ms: list[float], count: int, repeats: int) -> dict[float, list[tuple[float, float]]]:
    topic = "idle-hop-" + uuid.uuid4().hex[:8]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, enable_idempotence=True)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, fetch_max_wait_ms=500, auto_offset_reset="latest")
    await producer.start()
    await consumer.start()
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def read() -> None:
        async for _ in consumer:
            arrived.put_nowait(time.perf_counter())

    reader = asyncio.create_task(read())

    async def hop() -> float:
        sent = time.perf_counter()
        await producer.send(topic, b"x" * 300)
        return (await arrived.get() - sent) * 1000

    await asyncio.sleep(1.0)  # the consumer's first fetch is in place
    for _ in range(500):  # a broker just started is slower until its JIT has compiled the hot paths
        await hop()
    results: dict[float, list[tuple[float, float]]] = {gap: [] for gap in gaps_ms}
    for repeat in range(repeats):
        for gap in gaps_ms if repeat % 2 == 0 else gaps_ms[::-1]:
            hops = []
            for _ in range(count):
                if gap:
                    await asyncio.sleep(gap / 1000)
                hops.append(await hop())
            results[gap].append((percentile(hops, 50), percentile(hops, 90)))
    reader.cancel()
    await producer.stop()
    await consumer.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps-ms", type=lambda v: [float(g) for g in v.split(",")], default=[0.0, 5.0, 20.0, 100.0])
    parser.add_argument("--count", type=int, default=100, help="hops per gap and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with own_services("kafka-idle", 19792, 16879) as env:
        results = uvloop.run(measure(env["SLUICE_KAFKA_BOOTSTRAP"], args.gaps_ms, args.count, args.repeats))

    print(f"\n{args.count} hops per gap and repeat, {args.repeats} repeats; ms, median (min..max) over repeats\n")
    print("| idle before each hop | p50 | p90 |")
    print("| --- | --- | --- |")
    for gap, rows in results.items():
        print(f"| {gap:g} ms | {spread([r[0] for r in rows], '.2f')} | {spread([r[1] for r in rows], '.2f')} |")


if __name__ == "__main__":
    main()

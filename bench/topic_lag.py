"""How long each topic's records take from their producer's send() to a reader that does nothing else.

    .venv/bin/python -m bench.topic_lag --bootstrap 127.0.0.1:19892 --seconds 25

Run it beside a system under load (for example `python -m bench.hop_latency --rate 50 --seconds 60`,
whose Kafka listens on 127.0.0.1:19892). It reads every `llm.*` topic from its end, outside any group,
and for each record takes its arrival wall time minus its CreateTime (set by the producer when send()
took it). Per topic, a key's first record in the window and its later ones are reported apart (on a
reply topic: an answer's chunk, then its terminal event). CreateTime is in whole milliseconds, so half
a millisecond is subtracted from every figure; same host, same clock.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.stats import percentile


async def lags(bootstrap: str, seconds: float) -> dict[str, list[float]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, fetch_max_wait_ms=500, auto_offset_reset="latest")
    await consumer.start()
    try:
        topics = sorted(t for t in await consumer.topics() if t.startswith("llm."))
        consumer.assign([TopicPartition(t, 0) for t in topics])  # makes the client fetch their metadata
        while not all(consumer.partitions_for_topic(t) for t in topics):
            await asyncio.sleep(0.05)
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t))]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        seen: set[tuple[str, bytes | None]] = set()
        found: dict[str, list[float]] = {}
        end = time.time() + seconds
        while time.time() < end:
            batch = await consumer.getmany(timeout_ms=200)
            now_ms = time.time() * 1000
            for tp, records in batch.items():
                for record in records:
                    which = "later" if (tp.topic, record.key) in seen else "first"
                    seen.add((tp.topic, record.key))
                    found.setdefault(f"{tp.topic} ({which})", []).append(now_ms - record.timestamp - 0.5)
        return found
    finally:
        await consumer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:19892")
    parser.add_argument("--seconds", type=float, default=25.0)
    args = parser.parse_args()
    found = asyncio.run(lags(args.bootstrap, args.seconds))
    print("| topic (a key's record) | n | mean ms | p50 ms | p90 ms |\n| --- | --- | --- | --- | --- |")
    for name, xs in sorted(found.items()):
        print(f"| {name} | {len(xs)} | {statistics.fmean(xs):.2f} | {percentile(xs, 50):.2f} | {percentile(xs, 90):.2f} |")


if __name__ == "__main__":
    main()

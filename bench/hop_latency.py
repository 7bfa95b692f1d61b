"""Where a request's time goes between the bridge's HTTP answer and its Kafka hops, at a low rate.

    .venv/bin/python -m bench.hop_latency                        # 20 requests/s for 15 s, `sluice run`, instant backend
    .venv/bin/python -m bench.hop_latency --processes 1 --rate 50

Starts its own Kafka and Redis and `sluice run` (the transport topology of bench/throughput.py), sends
non-streamed requests open-loop, then reads every topic back from the start and lines each request's
records up by key: the record timestamps (CreateTime, set by each producer, milliseconds) say when each
stage wrote its output. Reported per gap: p50 and p90 over the requests, milliseconds. The client's own
send and answer times bracket them. Timestamps are whole milliseconds, so a gap's p50 is within ~1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from bench import throughput
from bench.http_load import Pool
from bench.services import own_services
from bench.stats import percentile
from bench.throughput import PATH, SLUICE_PORT, Started, body, sluice_config, wait_ready
from pipeline import kafka
from pipeline import settings as settings_module
from pipeline.settings import Settings

KAFKA_PORT, REDIS_PORT = 19892, 17179


async def send_paced(pool: Pool, bodies: list[bytes], rate: float) -> list[tuple[float, float, bytes]]:
    """(sent, answered, body) per request, wall-clock seconds."""
    async def one(i: int, b: bytes) -> tuple[float, float, bytes]:
        await asyncio.sleep(i / rate)
        sent = time.time()
        _, answer = await pool.post(PATH, b)
        return sent, time.time(), answer
    return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


async def records(settings: Settings) -> dict[str, list[tuple[str, int]]]:
    """Every record of every llm.* topic up to its end now, by the client's request id (keys are
    `<tenant>/<id>` past ingest): [(topic, timestamp ms)]."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        topics = tuple(sorted(t for t in await admin.list_topics() if t.startswith("llm.")))
    finally:
        await admin.close()
    consumer = await kafka.broadcast_consumer(settings, topics, "bench-hop-latency", from_start=True)
    try:
        by_key: dict[str, list[tuple[str, int]]] = defaultdict(list)
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for tp, msgs in (await consumer.getmany(timeout_ms=1000, max_records=5000)).items():
                for m in msgs:
                    if m.key:
                        by_key[m.key.decode(errors="replace").rpartition("/")[2]].append((tp.topic, m.timestamp))
        return by_key
    finally:
        await consumer.stop()


async def run(args: argparse.Namespace) -> None:
    with own_services("bench-hop-latency", KAFKA_PORT, REDIS_PORT) as env:
        config = sluice_config("instant", False, args.processes, 0)
        config = config.replace(f"127.0.0.1:{throughput.KAFKA_PORT}", env["SLUICE_KAFKA_BOOTSTRAP"]).replace(
            f"redis://127.0.0.1:{throughput.REDIS_PORT}/0", env["SLUICE_REDIS_URL"])
        path = Path(tempfile.mkdtemp(prefix="bench-hop-")) / "sluice.toml"
        path.write_text(config)
        server = Started("hop-latency", [sys.executable, "-m", "pipeline.cli", "run"],
                         {**env, "SLUICE_CONFIG": str(path)}, SLUICE_PORT)
        try:
            await wait_ready(SLUICE_PORT, PATH, body(0, 16))
            pool = Pool("127.0.0.1", SLUICE_PORT)
            await send_paced(pool, [body(i, 16) for i in range(int(args.rate * args.warmup_s))], args.rate)
            cut = time.time()
            done = await send_paced(pool, [body(i, 16) for i in range(int(args.rate * args.seconds))], args.rate)
            pool.close()
            by_key = await records(settings_module.load(env={**env, "SLUICE_CONFIG": str(path)}))
        finally:
            server.stop()
    gaps: dict[str, list[float]] = defaultdict(list)
    counts: Counter[str] = Counter()
    for sent, answered, answer in done:
        request_id = json.loads(answer)["id"].removeprefix("chatcmpl-")
        hops = sorted(by_key.get(request_id, []), key=lambda r: r[1])
        if not hops or hops[0][1] < cut * 1000 - 1:
            continue
        firsts: dict[str, int] = {}
        for topic, ts in hops:
            name = topic.rsplit(".", 1)[0] if topic.startswith("llm.routed.") else topic
            if name not in firsts:
                firsts[name] = ts
            else:
                firsts[f"{name} (last)"] = ts
            counts[name] += 1
        points = [("client sent", sent * 1000), *sorted(firsts.items(), key=lambda kv: kv[1]), ("client answered", answered * 1000)]
        for (a, ta), (b, tb) in zip(points, points[1:], strict=False):
            gaps[f"{a} -> {b}"].append(tb - ta)
        gaps["total"].append((answered - sent) * 1000)
    # A row per pair of consecutive points (a topic's first record, and its last where it had more than
    # one); the rare requests whose records interleaved otherwise add rows of their own, with a small n.
    print(f"| gap ({args.rate:g}/s, processes {args.processes or 'one per core'}) | p50 ms | p90 ms | n |")
    print("| --- | --- | --- | --- |")
    for name, values in gaps.items():
        print(f"| {name} | {percentile(values, 50):.2f} | {percentile(values, 90):.2f} | {len(values)} |")
    print("records per request: " + ", ".join(f"{t} {c / len(gaps['total']):.1f}" for t, c in counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--processes", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

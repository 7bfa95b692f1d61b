"""Routing under faults: three OpenAI-compatible upstreams (bench.fake_openai) behind three pools, one
of which fails (HTTP 500) for a phase, then stalls past the backend's timeout for another, under an
open-loop load; the stages run in this process on their own Kafka and Redis (ports 19392/16679).

    .venv/bin/python -m bench.routing_faults [--rate 40] [--phase-s 10]

Reports: requests that succeeded (every answer checked word for word; an error is a failure), when the
failing member was ejected after its 5th consecutive failure (the health report on llm.backend.health
against the upstream's own clock of refusals), and how many requests reached it after that.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from bench.fake_openai import FakeUpstream
from bench.services import own_services
from bench.stats import row
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.producing import Producer
from pipeline.sdk import Client, RequestFailed
from pipeline.serve import runners_for
from pipeline.settings import BackendSettings, Settings
from topics import codec, registry
from topics.health import BackendHealth

MODEL = "fake-model"
EXPECTED = "w0 w1 w2 w3 w4 w5 w6 w7 "


async def watch_ejection(settings: Settings, backend: str, stop: asyncio.Event, seen: list[float]) -> None:
    """Appends the time of the first health report that ejects `backend`."""
    consumer = await kafka.broadcast_consumer(settings, (registry.HEALTH,), "bench-routing-watch")
    try:
        while not stop.is_set() and not seen:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                for record in records:
                    report = codec.decode(record.value or b"", BackendHealth)
                    if report.backend == backend and report.ejections >= 1 and not seen:
                        seen.append(time.time())
    finally:
        await consumer.stop()


async def measure(settings: Settings, args: argparse.Namespace) -> None:
    fakes = [FakeUpstream(port) for port in (18901, 18902, 18903)]
    for fake in fakes:
        await fake.__aenter__()
    backends = tuple(BackendSettings(name=f"up{i}", model=MODEL, pool=f"up{i}", kind="openai", base_url=f.base_url,
                                     timeout_s=2.0, max_batch=16) for i, f in enumerate(fakes))
    settings = dataclasses.replace(settings, backends=backends, profile="routing",
                                   profiles={**settings.profiles, "routing": ("ingest", "route", "prefill", "decode", "emit")},
                                   cache=dataclasses.replace(settings.cache, enabled=False))
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    stages = assemble.build(assemble.nodes_of(settings), settings, backend_registry.load(settings))
    producer = Producer(settings, "sluice-stages-bench")  # as `sluice run` wires them (handover included)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "bench")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    failing = fakes[1]

    ejected: list[float] = []
    watcher = asyncio.create_task(watch_ejection(settings, "up1", stop, ejected))
    outcomes: list[str] = []
    latencies: list[float] = []
    async with Client(settings, model=MODEL) as client:
        async def one(i: int) -> None:
            t = time.perf_counter()
            try:
                answer = await client.complete(messages=[{"role": "user", "content": f"question {i}"}], max_tokens=8)
                outcomes.append("ok" if answer.text == EXPECTED else "wrong")
            except RequestFailed as exc:
                outcomes.append(exc.code.value)
            latencies.append((time.perf_counter() - t) * 1000)

        async def phases() -> None:
            await asyncio.sleep(args.phase_s)  # healthy
            failing.state.mode = "fail"
            await asyncio.sleep(args.phase_s)
            failing.state.mode, failing.state.stall_s = "stall", 5.0
            await asyncio.sleep(args.phase_s)
            failing.state.mode = "ok"

        phase_task = asyncio.create_task(phases())
        start, n = time.perf_counter(), int(args.rate * args.phase_s * 4)
        pending = []
        for i in range(n):
            delay = start + i / args.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.create_task(one(i)))
        await asyncio.gather(*pending)
        await phase_task
    stop.set()
    await asyncio.gather(*tasks, watcher)
    await producer.stop()
    for fake in fakes:
        await fake.__aexit__()
    ok = outcomes.count("ok")
    refusals = failing.state.refused_at
    print(f"\nrate={args.rate}/s phase={args.phase_s}s requests={len(outcomes)} (healthy, then up1 failing, then stalling 5 s, then healthy)\n")
    print(f"succeeded: {ok}/{len(outcomes)} = {100 * ok / len(outcomes):.2f}%  (others: {sorted(set(outcomes) - {'ok'})})")
    if len(refusals) >= 5 and ejected:
        fifth = refusals[4]
        after = sum(1 for t in refusals if t > ejected[0])
        print(f"ejected {1000 * (ejected[0] - fifth):.0f} ms after the 5th consecutive failure; {after} requests reached it after that")
    else:
        print(f"not ejected (refusals: {len(refusals)})")
    print("\n| requests | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    print(row("end to end (SDK), all phases", latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--phase-s", type=float, default=10.0)
    args = parser.parse_args()
    with own_services("bench-routing", 19392, 16679) as env:
        asyncio.run(measure(settings_module.load(env=env), args))

if __name__ == "__main__":
    main()

"""Pipeline overhead: end-to-end latency through every stage minus a direct call to the same backend,
with the same prompts, in the same run; plus where the time goes (handler time per stage, and the
Kafka hops between them).

    .venv/bin/python -m bench.pipeline_overhead --without-guards   # transport only, echo backend, 50 requests/s
    .venv/bin/python -m bench.pipeline_overhead --rate 10          # every stage, guards included
    .venv/bin/python -m bench.pipeline_overhead --backend model --rate 2 --requests 40

Starts its own Kafka and Redis (infra/services.sh, ports 19092/16379) unless --bootstrap is given, and
runs the stages in this process as `sluice run` does. Requests are sent open-loop at a fixed rate.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from bench.echo_backend import EchoBackend
from bench.stats import row, summary
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.backends.base import Backend
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings
from pipeline.stages.generation import generation_request

ROOT = Path(__file__).resolve().parent.parent
ALL_STAGES = "guarded"  # every stage, guards included
TRANSPORT_ONLY = "bare"  # --without-guards: the foundation topology
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python.",
    "Explain what a Kafka consumer group is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Name a prime number larger than 100.",
]


async def paced(n: int, rate: float, call: Callable[[int], Awaitable[float]]) -> list[float]:
    """Starts call(i) every 1/rate seconds (open loop) and returns each call's latency in ms."""
    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call(i)))
    return list(await asyncio.gather(*tasks))


async def measure(settings: Settings, backend: Backend, args: argparse.Namespace) -> None:
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    settings = replace(settings, profile=args.profile)  # the graph wires the topics: no stage is patched
    nodes = assemble.nodes_of(settings)
    args.stages = [n.name for n in nodes]
    stages = assemble.build(nodes, settings, {"local": backend})
    producer = Producer(settings, "sluice-stages-bench")  # as `sluice run` wires them (handover included)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "bench")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    timings: list[dict[str, float]] = []
    async with Client(settings) as client:

        async def direct(i: int) -> float:
            request = client.request(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=args.max_tokens)
            t = time.perf_counter()
            async for _ in backend.generate(generation_request(request, request.id)):
                pass
            return (time.perf_counter() - t) * 1000

        async def through(i: int) -> float:
            t = time.perf_counter()
            answer = await client.complete(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=args.max_tokens)
            timings.append(answer.done.timings)
            return (time.perf_counter() - t) * 1000

        await paced(min(20, args.requests), args.rate, through)  # warm-up: connections, caches, JIT of the model path
        timings.clear()
        direct_ms = await paced(args.requests, args.rate, direct)
        pipeline_ms = await paced(args.requests, args.rate, through)
    stop.set()
    await asyncio.gather(*tasks)
    await producer.stop()
    report(args, direct_ms, pipeline_ms, timings)


def report(args: argparse.Namespace, direct_ms: list[float], pipeline_ms: list[float], timings: list[dict[str, float]]) -> None:
    d, p = summary(direct_ms), summary(pipeline_ms)
    print(f"\nstages={','.join(args.stages)}\nbackend={args.backend} rate={args.rate}/s requests={args.requests} max_tokens={args.max_tokens}\n")
    print("| measured | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    print(row("direct call to the backend", direct_ms))
    print(row("through every stage (SDK to terminal event)", pipeline_ms))
    print(f"| **overhead** (pipeline minus direct) | **{p['p50'] - d['p50']:.2f}** | **{p['p99'] - d['p99']:.2f}** | {p['mean'] - d['mean']:.2f} | |")
    print("\nWhere the time goes (from each terminal event's `timings`):\n")
    print("| part | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    for stage in args.stages:
        print(row(f"{stage} handler", [t[stage] for t in timings if stage in t]))
    hops = [t["total"] - sum(t.get(s, 0.0) for s in args.stages) for t in timings]
    n = len(args.stages)  # hops between stages, plus the client's: one per stage
    print(row(f"Kafka hops and queues (total minus handlers; {n} hops)", hops))
    print(row(f"per hop (the above / {n})", [h / n for h in hops]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["echo", "model"], default="echo")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second, open loop")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--bootstrap", help="use a running Kafka instead of starting one")
    parser.add_argument("--redis", help="with --bootstrap: the running Redis's URL")
    parser.add_argument("--without-guards", action="store_true", help="the foundation topology: no guard, no postguard")
    args = parser.parse_args()
    args.profile = TRANSPORT_ONLY if args.without_guards else ALL_STAGES
    state = ROOT / ".state" / "bench"
    env = {"SLUICE_KAFKA_BOOTSTRAP": args.bootstrap or "127.0.0.1:19092", "SLUICE_REDIS_URL": args.redis or "redis://127.0.0.1:16379/0"}
    settings = settings_module.load(env=env)
    settings = replace(settings, runtime=replace(settings.runtime, max_in_flight=256))
    if not args.bootstrap:
        subprocess.run(["rm", "-rf", str(state)], check=True)
        subprocess.run([ROOT / "infra" / "services.sh", "start", state, "19092", "16379"], check=True)
    try:
        backend: Backend = EchoBackend() if args.backend == "echo" else backend_registry.load(settings)["local"]
        backend.name = "local"  # type: ignore[misc]  # the configured backend it stands in for (assemble looks it up)
        asyncio.run(measure(settings, backend, args))
    finally:
        if not args.bootstrap:
            subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)


if __name__ == "__main__":
    main()

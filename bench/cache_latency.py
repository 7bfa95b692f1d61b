"""Cache hits against misses, end to end through the bridge (HTTP, non-streamed), in one run, interleaved.

    .venv/bin/python -m bench.cache_latency                      # the default (guarded) profile
    .venv/bin/python -m bench.cache_latency --without-guards     # ingest, cache, route, prefill, decode, emit
    .venv/bin/python -m bench.cache_latency --no-handover        # every hop through the broker (runtime.handover off)
    .venv/bin/python -m bench.cache_latency --warmup-s 0         # no warm-up: measured just after the start

Each round asks three questions one after another: a new one (a miss: the default model generates it),
one asked before word for word (an exact hit) and a paraphrase of one asked before (a semantic hit).
Before the rounds, the tenant's semantic index is filled with `--entries` entries (random unit vectors
under other contexts' keys: the search's cost depends on their number, not their content), so a
semantic hit searches an index of that size. Then `--warmup-s` seconds of exact hits back to back (a
broker just started is slower until its JIT has compiled its hot paths). Starts its own Kafka and Redis
(ports 49292/46579).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import replace

import httpx
import numpy as np

from bench.services import own_services
from bench.stats import row
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.bridge import serve
from pipeline.cache.index import from_vector
from pipeline.guard.embedder import DIMS
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings
from topics import codec, registry
from topics.cache import Entry

PAIRS = [  # (asked first, its paraphrase): a semantic hit at the default threshold
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "What's the capital of France?"),
    ("How do I boil an egg?", "How should I boil an egg?"),
    ("What is a good name for a cat?", "What's a good name for a cat?"),
    ("How do I make a cup of tea?", "How can I make a cup of tea?"),
]


async def fill(settings: Settings, tenant: str, model: str, n: int) -> None:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((n, DIMS)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    producer = Producer(settings, "bench-cache-fill")
    await producer.start(asyncio.Event())
    now = time.time()
    try:
        for i, vector in enumerate(vectors):
            last = i == n - 1
            entry = Entry(key=f"bench/{i}", tenant=tenant, model=model, context=f"filler-{i % 50}", chunks=("x",),
                          finish_reason="stop", prompt_tokens=1, completion_tokens=1, stored_at=now, expires_at=now + 3600,
                          vector=from_vector(vector))
            if last:
                await producer.send_and_wait(registry.CACHE_ENTRIES, codec.encode(entry), key=entry.key.encode())
            else:
                await producer.send(registry.CACHE_ENTRIES, codec.encode(entry), key=entry.key.encode(), headers=[])
    finally:
        await producer.stop()


async def ask(http: httpx.AsyncClient, model: str, text: str) -> tuple[float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    t = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=body)
    ms = (time.perf_counter() - t) * 1000
    response.raise_for_status()
    return ms, response.headers["x-sluice-cache"]


async def warm_up(http: httpx.AsyncClient, model: str, seconds: float) -> int:
    """Exact hits back to back for `seconds`. Just after the start every hop is slower than it will be
    (probably mostly the broker: a JVM compiles its hot paths during its first minute of traffic, which
    session 9 measured for bench/throughput.py; not split here): an exact hit's p50 was 17 ms cold and
    9 ms after 12 s of hits, through the SDK, one run each. A running deployment is warm."""
    asked, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        await ask(http, model, PAIRS[asked % len(PAIRS)][0])
        asked += 1
    return asked


async def measure(settings: Settings, args: argparse.Namespace) -> None:
    await kafka.create_topics(settings)
    model = settings.models[0]
    await fill(settings, "default", model, args.entries)
    stop = asyncio.Event()
    stages = assemble.build(assemble.nodes_of(settings), settings, backend_registry.load(settings))
    producer = Producer(settings, "sluice-stages-bench")  # as `sluice run` wires them (handover included)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "bench")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    cache = next(s for s in stages if s.name == "cache")
    while len(cache.index) < args.entries:  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)
    results: dict[str, list[float]] = {"miss": [], "hit-exact": [], "hit-semantic": []}
    wrong: list[str] = []
    async with Client(settings, reply_name=settings.bridge.reply_name) as client:
        serving = asyncio.create_task(serve(settings, client, stop))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.bridge.port}", timeout=120) as http:
            for _ in range(100):
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.ConnectError:
                    await asyncio.sleep(0.1)
            for first, _ in PAIRS:  # stored once, before the rounds
                await ask(http, model, first)
            await asyncio.sleep(1.0)
            warm = await warm_up(http, model, args.warmup_s)
            for i in range(args.rounds):
                first, paraphrase = PAIRS[i % len(PAIRS)]
                for text, expected in ((f"Write one word about the number {uuid.uuid4().int % 10**9}.", "miss"),
                                       (first, "hit-exact"), (paraphrase, "hit-semantic")):
                    ms, tier = await ask(http, model, text)
                    (results[tier] if tier == expected else wrong).append(ms if tier == expected else f"{expected}->{tier}")  # type: ignore[arg-type]
        stop.set()
        await serving
    await asyncio.gather(*tasks)
    await producer.stop()
    print(f"\nprofile={settings.profile} entries in the tenant's index={len(cache.index)} rounds={args.rounds}"  # type: ignore[attr-defined]
          f" warm-up={args.warmup_s:g} s ({warm} exact hits)\n")
    print("| request (through the bridge, non-streamed) | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    for name, values in results.items():
        if values:
            print(row(name, values))
    if wrong:
        print(f"\nnot served as expected: {len(wrong)} ({', '.join(sorted(set(map(str, wrong))))})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--warmup-s", type=float, default=20.0, help="exact hits back to back before the rounds (0: a cold broker)")
    parser.add_argument("--without-guards", action="store_true")
    parser.add_argument("--no-handover", action="store_true", help="every hop through the broker (runtime.handover off)")
    args = parser.parse_args()
    with own_services("bench-cache", 49292, 46579) as env:
        settings = settings_module.load(env={**env, "SLUICE_BRIDGE_PORT": "48480"})
        if args.without_guards:
            profile = ("ingest", "cache", "route", "prefill", "decode", "emit")
            settings = replace(settings, profiles={**settings.profiles, "cached": profile}, profile="cached")
        if args.no_handover:
            settings = replace(settings, runtime=replace(settings.runtime, handover=False))
        asyncio.run(measure(settings, args))

if __name__ == "__main__":
    main()

"""Cache hits against misses, end to end through the bridge (HTTP, non-streamed), in one run, interleaved.

    .venv/bin/python -m bench.cache_latency                      # the default (guarded) profile
    .venv/bin/python -m bench.cache_latency --without-guards     # ingest, cache, route, prefill, decode, emit
    .venv/bin/python -m bench.cache_latency --no-handover        # every hop through the broker (runtime.handover off)
    .venv/bin/python -m bench.cache_latency --warmup-s 0         # no warm-up: measured just after the start
    .venv/bin/python -m bench.cache_latency --client httpx       # the client the figures before session 29 used
    .venv/bin/python -m bench.cache_latency --gaps-ms 0,10,50,200,0   # then exact hits with idle gaps between them
    .venv/bin/python -m bench.cache_latency --after-miss-ms 30   # each round's exact hit 30 ms after its miss's answer

Each round asks three questions one after another: a new one (a miss: the default model generates it),
one asked before word for word (an exact hit) and a paraphrase of one asked before (a semantic hit).
Before the rounds, the tenant's semantic index is filled with `--entries` entries (random unit vectors
under other contexts' keys: the search's cost depends on their number, not their content), so a
semantic hit searches an index of that size. Then `--warmup-s` seconds of exact hits back to back (a
broker just started is slower until its JIT has compiled its hot paths). Starts its own Kafka and Redis
(ports 19292/16579).

Every stage and the bridge run in this process, wired as `sluice run --in-process` wires them (the
handovers, and emit handing replies to the bridge's client: a request crosses the broker once; so does
`sluice run`'s default `[run] bridges = "every"`, where each bridge sends to its own process's ingest;
with `bridges = "first"` about half the requests cross twice). The client runs in the same process, one
request at a time, so its own cost is in every figure. By
default it is the lean keep-alive client of `bench/http_load.py`, which bench/throughput.py uses too;
`--client httpx` (the figures up to session 28) spent about 1.4 ms more per exact hit on session 29's
host, in httpx's request and response handling (0.9 ms from the client's send to the bridge's produce
and 1.1 ms from the bridge's reader to the answer, against 1.7 and 1.7 ms with httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import numpy as np

from bench.http_load import Pool
from bench.services import own_services
from bench.stats import row
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.bridge import serve
from pipeline.cache import keys
from pipeline.cache.index import from_vector
from pipeline.cache.traps import salient
from pipeline.guard.embedder import DIMS
from pipeline.observability import recent
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings
from topics import codec, registry
from topics.cache import Entry

PATH = "/v1/chat/completions"
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
    summary = msgspec.msgpack.encode(salient("a filler question"))  # an entry without one is unreadable and skipped
    try:
        for i, vector in enumerate(vectors):
            last = i == n - 1
            entry = Entry(key=f"{keys.scope(tenant, model)}bench-{i}", tenant=tenant, model=model, context=f"filler-{i % 50}", chunks=("x",),
                          finish_reason="stop", prompt_tokens=1, completion_tokens=1, stored_at=now, expires_at=now + 3600,
                          vector=from_vector(vector), salient=summary)
            if last:
                await producer.send_and_wait(registry.CACHE_ENTRIES, codec.encode(entry), key=entry.key.encode())
            else:
                await producer.send(registry.CACHE_ENTRIES, codec.encode(entry), key=entry.key.encode(), headers=[])
    finally:
        await producer.stop()


async def ask(http: httpx.AsyncClient | Pool, model: str, text: str) -> tuple[float, str]:
    """One question through the bridge: (milliseconds to the whole answer, its x-sluice-cache header)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    if isinstance(http, Pool):
        payload = json.dumps(body).encode()
        t = time.perf_counter()
        status, head, answer = await http.exchange(PATH, payload)
        ms = (time.perf_counter() - t) * 1000
        if status != 200:
            raise RuntimeError(f"the bridge answered {status}: {answer[:200]!r}")
        return ms, header(head, b"x-sluice-cache")
    t = time.perf_counter()
    response = await http.post(PATH, json=body)
    ms = (time.perf_counter() - t) * 1000
    response.raise_for_status()
    return ms, response.headers["x-sluice-cache"]


def header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        field, _, value = line.partition(b":")
        if field.strip().lower() == name:
            return value.strip().decode()
    raise RuntimeError(f"the answer has no {name.decode()} header")


async def warm_up(http: httpx.AsyncClient | Pool, model: str, seconds: float) -> int:
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
    client = Client(settings, reply_name=settings.bridge.reply_name)  # the bridge's (started below): emit hands it replies
    runners = runners_for(stages, settings, producer, "bench", client)
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    cache = next(s for s in stages if s.name == "cache")
    while len(cache.index) < args.entries:  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)
    results: dict[str, list[float]] = {"miss": [], "hit-exact": [], "hit-semantic": []}
    wrong: list[str] = []
    async with client:
        serving = asyncio.create_task(serve(settings, client, stop))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.bridge.port}", timeout=120) as http:
            for _ in range(100):
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.ConnectError:
                    await asyncio.sleep(0.1)
            client = http if args.client == "httpx" else Pool("127.0.0.1", settings.bridge.port)
            for first, _ in PAIRS:  # stored once, before the rounds
                await ask(client, model, first)
            await asyncio.sleep(1.0)
            recent.REQUESTS = recent.RecentRequests(size=1_000_000)  # every terminal event from here on, in order
            warm = await warm_up(client, model, args.warmup_s)
            in_rounds = len(recent.REQUESTS.items())
            for i in range(args.rounds):
                first, paraphrase = PAIRS[i % len(PAIRS)]
                for text, expected in ((f"Write one word about the number {uuid.uuid4().int % 10**9}.", "miss"),
                                       (first, "hit-exact"), (paraphrase, "hit-semantic")):
                    if expected == "hit-exact" and args.after_miss_ms:
                        await asyncio.sleep(args.after_miss_ms / 1000)
                    ms, tier = await ask(client, model, text)
                    (results[tier] if tier == expected else wrong).append(ms if tier == expected else f"{expected}->{tier}")  # type: ignore[arg-type]
            spaced = await exact_hits_spaced(client, model, args.gaps_ms, args.gap_seconds) if args.gaps_ms else {}
            if isinstance(client, Pool):
                client.close()
        stop.set()
        await serving
    await asyncio.gather(*tasks)
    await producer.stop()
    print(f"\nprofile={settings.profile} entries in the tenant's index={len(cache.index)} rounds={args.rounds}"  # type: ignore[attr-defined]
          f" warm-up={args.warmup_s:g} s ({warm} exact hits) client={args.client} after-miss={args.after_miss_ms:g} ms\n")
    print("| request (through the bridge, non-streamed) | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    for name, values in results.items():
        if values:
            print(row(name, values))
    if wrong:
        print(f"\nnot served as expected: {len(wrong)} ({', '.join(sorted(set(map(str, wrong))))})")
    print_stage_timings(recent.REQUESTS.items(), in_rounds)
    if spaced:
        print(f"\nexact hits only, {args.gap_seconds:g} s per gap, in the order given\n")
        print("| idle gap before each hit | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
        for name, values in spaced.items():
            print(row(name, values))


def print_stage_timings(finished: list[dict[str, Any]], in_rounds: int) -> None:
    """Where a hit's time goes, from the timings its terminal event carries (each stage's own handling, ms;
    `total`: from the bridge's stamp to emit): the warm-up's last exact hits (back to back) against the
    rounds' hits, each right after its miss. The bridge sees one request at a time, so its terminal events
    come in the order asked: the warm-up's, then miss, exact, semantic per round."""
    rounds = finished[in_rounds:]
    groups = {"exact, back to back": finished[max(0, in_rounds - 200):in_rounds],
              "exact, after a miss": rounds[1::3], "semantic, after an exact hit": rounds[2::3]}
    stages = [k for k in ("ingest", "guard", "cache", "emit", "total") if any(k in item["timings"] for item in rounds)]
    print("\n| hits (p50 of each stage's timing, ms) | " + " | ".join(stages) + " | n |")
    print("| --- |" + " --- |" * (len(stages) + 1))
    for name, items in groups.items():
        cells = [f"{np.median([i['timings'][k] for i in items if k in i['timings']]):.2f}" for k in stages]
        print(f"| {name} | " + " | ".join(cells) + f" | {len(items)} |")


async def exact_hits_spaced(client: httpx.AsyncClient | Pool, model: str, gaps_ms: list[float], seconds: float) -> dict[str, list[float]]:
    """Exact hits one after another with `gap` ms of idle time before each, `seconds` per gap: how an
    exact hit's latency depends on how busy the pipeline is (back to back, every process and the broker
    stay awake; after an idle gap each hop starts from sleeping threads). Keyed "<gap> ms (#k)"."""
    out: dict[str, list[float]] = {}
    for k, gap in enumerate(gaps_ms):
        latencies, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            await asyncio.sleep(gap / 1000)
            ms, tier = await ask(client, model, PAIRS[0][0])
            if tier != "hit-exact":
                raise RuntimeError(f"an exact repeat was served as {tier}")
            latencies.append(ms)
        out[f"{gap:g} ms (#{k + 1})"] = latencies
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--warmup-s", type=float, default=20.0, help="exact hits back to back before the rounds (0: a cold broker)")
    parser.add_argument("--without-guards", action="store_true")
    parser.add_argument("--no-handover", action="store_true", help="every hop through the broker (runtime.handover off)")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean", help="the HTTP client that asks (see above)")
    parser.add_argument("--gaps-ms", type=lambda v: [float(g) for g in v.split(",")], default=[],
                        help="after the rounds, exact hits with this idle time before each, e.g. 0,10,50,200,0")
    parser.add_argument("--after-miss-ms", type=float, default=0.0, help="idle time between each round's miss and its exact hit")
    parser.add_argument("--gap-seconds", type=float, default=8.0, help="how long each gap of --gaps-ms runs")
    args = parser.parse_args()
    with own_services("bench-cache", 19292, 16579) as env:
        settings = settings_module.load(env={**env, "SLUICE_BRIDGE_PORT": "18480"})
        if args.without_guards:
            profile = ("ingest", "cache", "route", "prefill", "decode", "emit")
            settings = replace(settings, profiles={**settings.profiles, "cached": profile}, profile="cached")
        if args.no_handover:
            settings = replace(settings, runtime=replace(settings.runtime, handover=False))
        asyncio.run(measure(settings, args))

if __name__ == "__main__":
    main()

"""Memory and garbage collection per request under steady load, window by window: the transport stages
(`bare` profile: ingest, route, prefill, decode, emit) on the echo backend and the SDK client in this
process, 32 requests in flight, tracing off. Per window: requests/s, this process's CPU per request, the
collector's time per request (gc.callbacks) and full collections, RSS, objects the collector tracks, and
with --types the object types that grew most since the previous window. A process that keeps something
per request shows as objects and RSS growing from window to window.

    .venv/bin/python -m bench.memory_windows --windows 10 --seconds 20 --types   # emit's leak (session 21)
    .venv/bin/python -m bench.memory_windows --windows 3 --seconds 15 --gc default|freeze|settled

--gc: `default` Python's collector as it is; `freeze` gc.freeze() after the warm-up; `settled` what
`runtime.gc_threshold` does (pipeline.serve.settle_gc: freeze, and the youngest generation collected every
10,000 net allocations). Starts its own Kafka and Redis (ports 18092/15379).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import subprocess
import time
from dataclasses import replace

from bench.echo_backend import EchoBackend
from bench.tracing_overhead import ROOT, throughput
from pipeline import assemble, kafka, serve
from pipeline import settings as settings_module
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings


class GcClock:
    """Seconds spent in the collector, and full collections, since this process started it."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


async def measure(settings: Settings, args: argparse.Namespace) -> None:
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    echo = EchoBackend()
    echo.name = settings.backends[0].name  # type: ignore[misc]  # stands in for the configured backend
    stages = assemble.build(assemble.nodes_of(settings), settings, {echo.name: echo})
    producer = Producer(settings, "sluice-stages-memory")
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "memory")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    clock = GcClock()
    async with Client(settings) as client:
        await throughput(client, 32, 10, 8)  # warm-up
        if args.gc == "freeze":
            gc.freeze()
        elif args.gc == "settled":
            serve.settle_gc(settings)
        print(f"gc {args.gc}: threshold {gc.get_threshold()}, frozen {gc.get_freeze_count()}", flush=True)
        previous: collections.Counter[str] = collections.Counter()
        for window in range(args.windows):
            gc_s, full, cpu = clock.seconds, clock.full, time.process_time()
            done, seconds = await throughput(client, 32, args.seconds, 8)
            cpu = time.process_time() - cpu
            print(f"window {window}: {done / seconds:.1f} req/s, {cpu / done * 1000:.2f} ms CPU/req, "
                  f"gc {(clock.seconds - gc_s) / done * 1000:.3f} ms/req ({clock.full - full} full), "
                  f"rss {rss_mib():.0f} MiB, objects {len(gc.get_objects())}", flush=True)
            if args.types:
                counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
                if window:
                    grown = (counts - previous).most_common(8)
                    print("  grew since the last window:", ", ".join(f"{name} +{n}" for name, n in grown), flush=True)
                previous = counts
    stop.set()
    await asyncio.gather(*tasks)
    await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="closed-loop load per window")
    parser.add_argument("--gc", choices=("default", "freeze", "settled"), default="default")
    parser.add_argument("--types", action="store_true", help="print the object types that grew most per window")
    args = parser.parse_args()
    env = {"SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:18092", "SLUICE_REDIS_URL": "redis://127.0.0.1:15379/0"}
    settings = settings_module.load(env=env)
    settings = replace(settings, profile="bare", runtime=replace(settings.runtime, max_in_flight=256))
    state = ROOT / ".state" / "bench-memory"
    subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=False, capture_output=True)
    subprocess.run(["rm", "-rf", str(state)], check=True)
    subprocess.run([ROOT / "infra" / "services.sh", "start", state, "18092", "15379"], check=True, capture_output=True)
    try:
        asyncio.run(measure(settings, args))
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)


if __name__ == "__main__":
    main()

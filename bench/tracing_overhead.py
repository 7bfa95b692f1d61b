"""What tracing costs: every request traced (100% sampled, exported over OTLP/HTTP in batches) against
tracing off (sample_ratio = 0: context still propagates, no span is recorded or exported), in one
process running the transport stages (`bare` profile: ingest, route, prefill, decode, emit) on the echo
backend, so the spans' cost is not hidden behind a model.

    .venv/bin/python -m bench.tracing_overhead                    # 5 rounds, both modes in each, order alternating
    .venv/bin/python -m bench.tracing_overhead --rounds 7 --rate 20 --requests 200 --concurrency 32 --seconds 10 --slices 5

Each round measures latency at a fixed open-loop rate (p50, p99 over `--requests` per mode), then
throughput closed-loop at `--concurrency` requests in flight for `--seconds` per mode (the knee: where
adding load only adds queueing). Each part alternates the modes in `--slices` short slices (on, off,
off, on, ...; which goes first alternates by round), so that a neighbour's burst on a shared host
falls on both modes alike instead of on one mode's whole half of the round; the spans of a slice are
flushed (untimed) before the next one starts, so no mode's export runs in the other's time (which
also leaves the export of each "on" slice's last spans out of the timed part: a bias towards "on"). The
sampler is switched between modes inside one process (same stages, same connections). Spans go to a sink in its own process that
reads each OTLP request and answers 200, so export costs what it costs over HTTP. Reported: each
mode's median over rounds, the per-round difference (on minus off, on / off) as median with min..max,
and this process's CPU per request in the throughput part, the slice's flush included (so the export's
CPU counts against "on"; at the knee one process is bound by it, and it moves less than throughput
with the host's neighbours).

`--modes on,off,on-recorded` adds a third mode to the rotation, reported against "off": spans recorded
and not exported (what recording alone costs, so that the export's share is the rest); `on-thread`
exports from the batch processor's thread in this process (`observability.export_process = false`, the
default before session 22) instead of from the export child. The CPU per request counts the export
child's CPU with this process's.

Then `--connected` requests (1,000) with tracing on: how many of their traces are one connected tree in
which the terminal event's path passes every stage, in pipeline order.

Starts its own Kafka and Redis (ports 18092/15379) unless --bootstrap is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import psutil
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

from bench.echo_backend import EchoBackend
from bench.pipeline_overhead import PROMPTS, paced
from bench.stats import percentile
from pipeline import assemble, kafka, serve, tracing
from pipeline import settings as settings_module
from pipeline.observability.config import ObservabilitySettings
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the exporter's connection alive, as OTLP collectors do
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
"""


class Links(SpanProcessor):
    """Records each ended span's ids, parent, name and kind, for the connected-trace check."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int | None, str, SpanKind, int, int]] = []

    def on_end(self, span: ReadableSpan) -> None:
        parent = span.parent.span_id if span.parent is not None else None
        self.spans.append((span.context.trace_id, span.context.span_id, parent, span.name, span.kind, span.start_time or 0,
                           span.end_time or 0))


def connected(spans: list[tuple[int, int, int | None, str, SpanKind, int, int]], roots: set[int], order: list[str]) -> int:
    """How many of the traces started by the client spans `roots` are one connected tree in which the
    terminal event's path (emit's last span and its ancestors) passes every stage once, in pipeline order."""
    by_trace: dict[int, list[tuple[int, int, int | None, str, SpanKind, int, int]]] = {}
    for s in spans:
        by_trace.setdefault(s[0], []).append(s)
    good = 0
    for trace_id in roots:
        mine = by_trace.get(trace_id, [])
        ids = {s[1]: s for s in mine}
        if sum(1 for s in mine if s[2] is None) != 1 or any(s[2] is not None and s[2] not in ids for s in mine):
            continue
        last = [s for s in mine if s[3] == order[-1] and s[4] is SpanKind.CONSUMER]
        if not last:
            continue
        node: tuple[int, int, int | None, str, SpanKind, int, int] | None = max(last, key=lambda s: s[6])
        path = []
        while node is not None:
            if node[4] is SpanKind.CONSUMER:
                path.append(node[3])
            node = ids.get(node[2]) if node[2] is not None else None
        good += path[::-1] == order
    return good


async def check_connected(client: Client, switch: Switch, choice: Choice, provider: object, settings: Settings,
                          args: argparse.Namespace) -> tuple[int, int]:
    links = Links()
    provider.add_span_processor(links)  # type: ignore[attr-defined]
    switch.on = True
    choice.mode = "on" if "on" in choice.processors else choice.mode
    await latency(client, args.connected, args.rate, args.max_tokens)
    await asyncio.sleep(2)  # the last requests' emit spans end after their terminal event
    roots = {s[0] for s in links.spans if s[2] is None and s[4] is SpanKind.CLIENT}
    order = [node.name for node in assemble.nodes_of(settings)]
    spans = [s for s in links.spans if s[0] in roots]
    print(f"spans per trace: {len(spans) / max(len(roots), 1):.1f}", flush=True)
    return connected(spans, roots, order), len(roots)


class Switch(Sampler):
    """The root decision, switched between modes; every later span follows its parent (ParentBased)."""

    def __init__(self) -> None:
        self.on = True

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
                      attributes: Attributes = None, links: Sequence[Link] | None = None, trace_state: object = None) -> SamplingResult:
        return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return "Switch"


class Choice(SpanProcessor):
    """Hands each ended span to the processor of the mode being measured: `on`, the batch processor and
    exporter `sluice run` installs; `on-thread`, the same exporting from this process; `on-recorded`, none."""

    def __init__(self, processors: dict[str, SpanProcessor]) -> None:
        self.processors = processors
        self.mode = next(iter(processors))

    def on_end(self, span: ReadableSpan) -> None:
        self.processors[self.mode].on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self.processors.values())

    def shutdown(self) -> None:
        for processor in self.processors.values():
            processor.shutdown()


async def latency(client: Client, n: int, rate: float, max_tokens: int) -> list[float]:
    async def one(i: int) -> float:
        t = time.perf_counter()
        await client.complete(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens)
        return (time.perf_counter() - t) * 1000

    return await paced(n, rate, one)


async def throughput(client: Client, concurrency: int, seconds: float, max_tokens: int) -> tuple[int, float]:
    """Requests done with `concurrency` in flight for about `seconds`, and the seconds it took (the last
    requests started before the end finish after it)."""
    done = 0
    end = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < end:
            await client.complete(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens)
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done, time.perf_counter() - start


LABELS = {"on": "100%, exported", "on-thread": "100%, exported from a thread of this process", "on-recorded": "100%, not exported"}


def choose(switch: Switch, choice: Choice, mode: str) -> None:
    """Measure `mode` next: the root sampler on or off, and the span processor of an "on" mode."""
    switch.on = mode != "off"
    if switch.on:
        choice.mode = mode


def rotated(modes: list[str], k: int) -> list[str]:
    """`modes` starting from the k-th (mod len): with two modes, on/off then off/on, alternating."""
    k %= len(modes)
    return modes[k:] + modes[:k]


async def measure(settings: Settings, switch: Switch, choice: Choice, provider: object,
                  args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    echo = EchoBackend()
    echo.name = settings.backends[0].name  # type: ignore[misc]  # stands in for the configured backend
    stages = assemble.build(assemble.nodes_of(settings), settings, {echo.name: echo})
    producer = Producer(settings, "sluice-stages-bench")  # as `sluice run` wires them (handover included)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "bench")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.gather(*(r.ready.wait() for r in runners))
    serve.settle_gc(settings)  # as pipeline.serve.run_stages does once the stages run (runtime.gc_threshold)
    modes = args.modes
    # per round and mode: latency percentiles, mean rate of the throughput slices, and their totals (requests
    # done, seconds taken, CPU seconds of this process), from which per-request CPU and pooled rates follow
    results: dict[str, dict[str, list[float]]] = {m: {"p50": [], "p99": [], "rps": [], "done": [], "busy": [], "cpu_s": [], "child_s": []}
                                                  for m in modes}
    async with Client(settings) as client:
        for mode in modes:  # warm-up of every mode and both loads, not recorded: the first closed-loop
            choose(switch, choice, mode)  # pass of a run was measured 10-15% slower whichever mode it measured
            await latency(client, 60, args.rate, args.max_tokens)
            await throughput(client, args.concurrency, args.seconds / 2, args.max_tokens)
        for r in range(args.rounds):
            lat: dict[str, list[float]] = {m: [] for m in modes}
            served: dict[str, list[tuple[int, float, float, float]]] = {m: [] for m in modes}  # requests, seconds, CPU s, of which the child's
            for part in ("latency", "throughput"):  # each part in `--slices` slices of every mode, the order rotating
                for s in range(args.slices):
                    for mode in rotated(modes, r + s):
                        choose(switch, choice, mode)
                        child_start = export_cpu(choice)
                        cpu_start = time.process_time() + child_start
                        if part == "latency":
                            lat[mode] += await latency(client, args.requests // args.slices, args.rate, args.max_tokens)
                        else:
                            done, seconds = await throughput(client, args.concurrency, args.seconds / args.slices, args.max_tokens)
                        provider.force_flush()  # type: ignore[attr-defined]  # a slice's spans leave before the next slice
                        if part == "throughput":  # the flush counted: the CPU of exporting the slice's spans is in
                            child = export_cpu(choice)
                            served[mode].append((done, seconds, time.process_time() + child - cpu_start, child - child_start))
            for mode in rotated(modes, r):
                results[mode]["p50"].append(percentile(lat[mode], 50))
                results[mode]["p99"].append(percentile(lat[mode], 99))
                results[mode]["rps"].append(statistics.fmean(n / t for n, t, _, _ in served[mode]))
                for key, i in (("done", 0), ("busy", 1), ("cpu_s", 2), ("child_s", 3)):
                    results[mode][key].append(sum(x[i] for x in served[mode]))
                print(f"round {r + 1} {mode:>3}: p50 {percentile(lat[mode], 50):.2f} ms  p99 {percentile(lat[mode], 99):.2f} ms  "
                      f"{results[mode]['rps'][-1]:.1f} req/s at {args.concurrency} in flight, "
                      f"{cpu_per_request(results[mode])[-1]:.2f} ms CPU per request", flush=True)
        if args.connected:
            good, total = await check_connected(client, switch, choice, provider, settings, args)
            results["connected"] = {"good": [good], "total": [total]}
    stop.set()
    await asyncio.gather(*tasks)
    await producer.stop()
    return results


def export_cpu(choice: Choice) -> float:
    """CPU seconds of the export children (pipeline.observability.export_child) so far: counted with this
    process's, so that exporting from a child costs what it costs."""
    total = 0.0
    for processor in choice.processors.values():
        pid = getattr(getattr(processor, "span_exporter", None), "pid", None)
        if pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
    return total


def cpu_per_request(result: dict[str, list[float]]) -> list[float]:
    """This process's CPU per request in the throughput part of each round, ms."""
    return [1000 * c / max(n, 1) for c, n in zip(result["cpu_s"], result["done"])]


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    off = results["off"]
    print(f"\nprofile=bare backend=echo max_tokens={args.max_tokens} rounds={args.rounds} rate={args.rate}/s "
          f"requests={args.requests} concurrency={args.concurrency} seconds={args.seconds} slices={args.slices} "
          f"load average={os.getloadavg()}")
    for mode in (m for m in args.modes if m != "off"):
        on = results[mode]
        p50_diff = [a - b for a, b in zip(on["p50"], off["p50"])]
        p99_diff = [a - b for a, b in zip(on["p99"], off["p99"])]
        rps_ratio = [a / b for a, b in zip(on["rps"], off["rps"])]
        cpu_ratio = [a / b for a, b in zip(cpu_per_request(on), cpu_per_request(off))]
        print(f"\n| measured | tracing off (ratio 0) | tracing {mode} ({LABELS[mode]}) | {mode} minus off, per round: median (min..max) |")
        print("| --- | --- | --- | --- |")
        print(f"| p50 latency, ms | {spread(off['p50'], '.2f')} | {spread(on['p50'], '.2f')} | {spread(p50_diff, '+.2f')} |")
        print(f"| p99 latency, ms | {spread(off['p99'], '.2f')} | {spread(on['p99'], '.2f')} | {spread(p99_diff, '+.2f')} |")
        print(f"| throughput at {args.concurrency} in flight, req/s | {spread(off['rps'], '.1f')} | {spread(on['rps'], '.1f')} | "
              f"{mode} / off {spread(rps_ratio, '.3f')} |")
        print(f"| CPU per request at {args.concurrency} in flight, ms (this process and its export child) | {spread(cpu_per_request(off), '.2f')} | "
              f"{spread(cpu_per_request(on), '.2f')} | {mode} / off {spread(cpu_ratio, '.3f')} |")
        pooled_on, pooled_off = sum(on["done"]) / sum(on["busy"]), sum(off["done"]) / sum(off["busy"])
        cpu_on, cpu_off = 1000 * sum(on["cpu_s"]) / sum(on["done"]), 1000 * sum(off["cpu_s"]) / sum(off["done"])
        print(f"| throughput, every slice of every round pooled (requests / seconds), req/s | {pooled_off:.1f} | {pooled_on:.1f} | "
              f"{mode} / off **{pooled_on / pooled_off:.3f}** |")
        print(f"| CPU per request, pooled, ms | {cpu_off:.2f} | {cpu_on:.2f} | {mode} / off {cpu_on / cpu_off:.3f} |")
        print(f"| of which the export child, pooled, ms | - | {1000 * sum(on['child_s']) / sum(on['done']):.2f} | |")
    if "connected" in results:
        good, total = results["connected"]["good"][0], results["connected"]["total"][0]
        print(f"\n{args.connected} requests sent, {total} client traces, {good} ({100 * good / max(total, 1):.1f}%) connected with every "
              f"stage's span on the terminal event's path in pipeline order")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second for the latency part, open loop")
    parser.add_argument("--requests", type=int, default=200, help="requests per mode per round for the latency part")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight for the throughput part")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the throughput part per mode per round")
    parser.add_argument("--slices", type=int, default=5, help="each part of a round alternates on/off this many times per mode")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--bootstrap", help="use a running Kafka instead of starting one")
    parser.add_argument("--redis", help="with --bootstrap: the running Redis's URL")
    parser.add_argument("--sink-port", type=int, default=14318)
    parser.add_argument("--modes", default="on,off", help="on (as sluice run exports: from a child process), off, on-thread (exported from a thread of this process), on-recorded (recorded, not exported)")
    parser.add_argument("--connected", type=int, default=1000, help="then this many requests traced: how many traces are whole")
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    if "off" not in args.modes or not set(args.modes) <= set(LABELS) | {"off"} or len(set(args.modes)) < len(args.modes):
        parser.error("--modes: off and one or more of on, on-thread, on-recorded, each once")
    env = {"SLUICE_KAFKA_BOOTSTRAP": args.bootstrap or "127.0.0.1:18092", "SLUICE_REDIS_URL": args.redis or "redis://127.0.0.1:15379/0"}
    settings = settings_module.load(env=env)
    settings = replace(settings, profile="bare", runtime=replace(settings.runtime, max_in_flight=256))
    state = ROOT / ".state" / "bench-tracing"
    if not args.bootstrap:  # a run that died may have left its services holding the state dir
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", str(state)], check=True)
        subprocess.run([ROOT / "infra" / "services.sh", "start", state, "18092", "15379"], check=True)
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(args.sink_port)])
    try:
        switch = Switch()
        provider = tracing.install(ObservabilitySettings(), sampler=ParentBased(root=switch))  # sluice's recorder, switchable
        endpoint = f"http://127.0.0.1:{args.sink_port}/v1/traces"
        exporting = ObservabilitySettings(otlp_endpoint=endpoint)  # the batch processor and exporter `sluice run` installs
        exporters = {"on": exporting, "on-thread": replace(exporting, export_process=False)}
        choice = Choice({m: tracing.batches(tracing.otlp_exporter(exporters[m]), exporting) if m in exporters else SpanProcessor()
                         for m in args.modes if m != "off"})
        provider.add_span_processor(choice)  # type: ignore[attr-defined]
        results = asyncio.run(measure(settings, switch, choice, provider, args))
        report(results, args)
    finally:
        sink.terminate()
        sink.wait()
        if not args.bootstrap:
            subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)


if __name__ == "__main__":
    main()

"""Backfill on the batch lane against the same prompts sent interactively one at a time, and what a
running backfill does to interactive latency: all in one run, on the default model.

    .venv/bin/python -m bench.backfill                     # 24 prompts x 32 tokens, 20 probes
    .venv/bin/python -m bench.backfill --prompts 48 --max-tokens 48 --probes 30
    .venv/bin/python -m bench.backfill --prompt-chars 4000 --distinct-load   # long prompts, none cached

Starts its own Kafka and Redis (ports 18192/18479), runs the bare profile (no guards, cache off: the
same prompts must not be answered from the cache) in this process with the local engine, and then:

1. interactive, one at a time: each prompt sent and answered before the next (tokens/s);
2. backfill: the same prompts as one batch job (files, Redis progress, the worker, priority batch,
   `batch.max_in_flight` lines at once), from creation to completed (tokens/s, from the output file);
   then the engine alone: the same prompts straight into the backend (no Kafka, no stages, no job),
   `batch.max_in_flight` at once on the batch lane: the batched rate the backfill should approach;
3. interactive latency, idle: `--probes` short requests one after another, each sent 0.1-0.3 s
   (uniform, seeded) after the last one's answer, so that they meet the engine's steps at every
   point (a fixed pause lands every probe at the same point of a batch step) (p50, p99);
4. the same probes while a larger backfill keeps the engine busy (p50, p99), then that job is cancelled.
   The larger backfill is the same prompts eight times over (their prefixes cached after the first
   pass: mostly decode), or with `--distinct-load` eight times as many other prompts, each prefilled.

`--blocks K` splits 3 and 4 into K blocks each, run ABBA (idle, busy, busy, idle, idle, busy, ...;
each busy block with a backfill of its own, cancelled and drained before the next block), so that
the host's speed drifting over the run falls on both modes alike; the p50 and p99 are over all the
probes of a mode.

`--step-trace` also prints the engine's steps during 3 and 4 (how many, how long, with which lanes'
rows: bench/step_trace.py), to tell what slows a probe: the steps it shares or what runs beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from bench.services import own_services
from bench.stats import percentile
from bench.step_trace import StepTrace
from pipeline import assemble, kafka
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.backends.base import Backend, GenerationRequest, Message
from pipeline.batch.execute import Executor
from pipeline.batch.files import FileStore
from pipeline.batch.records import TERMINAL, Batch, Status, new_batch_id
from pipeline.batch.redis_store import RedisJobStore
from pipeline.batch.worker import BatchWorker
from pipeline.gateway.build import redis_client
from pipeline.producing import Producer
from pipeline.sdk import Client
from pipeline.serve import runners_for
from pipeline.settings import Settings
from pipeline.sharegpt import first_turns

CHAT = "/v1/chat/completions"
PROBE = "Name one colour."


def prompts(n: int, chars: int = 300, skip: int = 0) -> list[str]:
    """ShareGPT first turns `skip` to `skip + n`, each cut to its first `chars` characters."""
    return [turn[:chars] for turn, _ in first_turns(skip + n)[skip:]]


def jsonl(texts: list[str], max_tokens: int) -> bytes:
    rows = ({"custom_id": f"p{i}", "method": "POST", "url": CHAT,
             "body": {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
                      "messages": [{"role": "user", "content": t}]}} for i, t in enumerate(texts))
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class Backfill:
    """Batch jobs run by a worker in this process, on the bench's client."""

    def __init__(self, settings: Settings, client: Client, root: Path) -> None:
        self.settings = settings
        self.store = RedisJobStore(redis_client(settings))
        self.files = FileStore(root, max_bytes=settings.batch.max_file_bytes, max_lines=settings.batch.max_lines)
        b = settings.batch
        self.worker = BatchWorker(b, self.store, self.files,
                                  lambda job: Executor(client, lambda r: r, deadline_s=b.line_deadline_s, max_attempts=b.max_attempts),
                                  poll_s=0.2)

    async def submit(self, data: bytes) -> str:
        record = self.files.upload("default", "in.jsonl", io.BytesIO(data))
        now = int(time.time())
        batch = Batch(new_batch_id(), "default", record.id, CHAT, now, now + 86400)
        await self.store.create(batch)
        return batch.id

    async def wait(self, batch_id: str, statuses: frozenset[Status] = TERMINAL) -> Batch:
        while True:
            batch = await self.store.get(batch_id)
            if batch is not None and batch.status in statuses:
                return batch
            await asyncio.sleep(0.1)

    def completion_tokens(self, batch: Batch) -> int:
        assert batch.output_file_id is not None
        path = self.files.path(self.files.get(batch.tenant, batch.output_file_id))
        return sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in path.read_bytes().splitlines())


WINDOWS: list[tuple[float, float, str]] = []  # every probe's start and end (perf_counter) and its phase, for --step-trace
PAUSES = random.Random(11)  # the pause before each probe: uniform 0.1-0.3 s (session 18; a fixed 0.2 s before)


async def probe(client: Client, n: int, max_tokens: int, phase: str = "idle") -> list[float]:
    """`n` short interactive requests one after another; their latencies (ms). Prints where the time went
    (each stage's mean from the terminal events' `timings`)."""
    latencies = []
    timings: dict[str, list[float]] = {}
    for _ in range(n):
        started = time.perf_counter()
        answer = await client.complete(messages=[{"role": "user", "content": PROBE}], max_tokens=max_tokens, no_cache=True)
        latencies.append((time.perf_counter() - started) * 1000)
        WINDOWS.append((started, time.perf_counter(), phase))
        for stage, ms in answer.done.timings.items():
            timings.setdefault(stage, []).append(ms)
        await asyncio.sleep(PAUSES.uniform(0.1, 0.3))
    print("  where: " + ", ".join(f"{stage} {sum(v) / len(v):.0f} ms" for stage, v in timings.items()), flush=True)
    return latencies


async def engine_alone(backends: dict[str, Backend], texts: list[str], max_tokens: int, in_flight: int) -> float:
    """Tokens/s of the same prompts sent straight to the backend, `in_flight` at once, batch lane, the
    bridge's tenant (so the prefix cache serves them as it serves the job's lines)."""
    backend = next(iter(backends.values()))
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, text: str) -> int:
        request = GenerationRequest(f"alone-{i}", messages=(Message("user", text),), max_tokens=max_tokens,
                                    tenant="default", priority="batch", stream=False)
        async with gate:
            return sum([len(delta.token_ids) async for delta in backend.generate(request)])

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, text) for i, text in enumerate(texts))))
    return tokens / (time.perf_counter() - started)


def block_order(blocks: int) -> list[str]:
    """The probes' phases, ABBA: idle, busy, busy, idle, idle, busy, ... (`blocks` of each)."""
    pairs = [("idle", "busy") if i % 2 == 0 else ("busy", "idle") for i in range(blocks)]
    return [mode for pair in pairs for mode in pair]


async def engine_idle(backends: dict[str, Backend], limit_s: float = 120.0) -> float:
    """Waits until no backend has a sequence waiting or running (a cancelled job's lines still in a
    step, or preempted and queued, would otherwise slow the next idle block); the seconds it took."""
    started = time.perf_counter()
    while any(getattr(b, "active_sequences", 0) for b in backends.values()) and time.perf_counter() - started < limit_s:
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def busy_block(backfill: Backfill, client: Client, texts: list[str], args: argparse.Namespace,
                     n: int, backends: dict[str, Backend]) -> tuple[list[float], int, tuple[float, float]]:
    """`n` probes while a larger backfill keeps the engine busy; the job is then cancelled and waited
    for, and the engine for its last sequences, so the next idle block starts idle. Returns the
    latencies, the lines the job finished meanwhile and the probes' window (perf_counter)."""
    load = await backfill.submit(jsonl(load_texts(texts, args), args.max_tokens * 2))
    await backfill.wait(load, frozenset({Status.in_progress}))
    await asyncio.sleep(5.0)  # the engine fills with batch-lane sequences
    started = time.perf_counter()
    latencies = await probe(client, n, args.probe_tokens, "busy")
    window = (started, time.perf_counter())
    counts = await backfill.store.counts(load)
    current = await backfill.store.get(load)
    if current is not None and current.status not in TERMINAL:
        await backfill.store.update(msgspec.structs.replace(current, status=Status.cancelling), {current.status})
    await backfill.wait(load)
    print(f"  the engine idle {await engine_idle(backends):.1f} s after the job ended", flush=True)
    return latencies, counts.completed, window


def load_texts(texts: list[str], args: argparse.Namespace) -> list[str]:
    """A busy block's backfill: the measured prompts eight times over (their prefixes cached after the
    first pass), or with `--distinct-load` eight times as many other prompts (every one prefilled)."""
    if args.distinct_load:
        return prompts(8 * len(texts), args.prompt_chars, skip=len(texts))
    return texts * 8


def engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The EngineConfig fields the command line sets (the others keep EngineConfig's defaults)."""
    chosen = {"batch_every": args.batch_every, "handoff_hold_ms": args.handoff_hold_ms,
              "batch_prompt_tokens": args.batch_prompt_tokens, "shared_prompt_tokens": args.shared_prompt_tokens,
              "interrupt_batch_steps": args.interrupt_within}
    return {k: v for k, v in chosen.items() if v is not None}


def local_backend(settings: Settings, overrides: dict[str, object]) -> dict[str, Backend]:
    """The default model as `backends.load` builds it, with the engine fields in `overrides`."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.backends.local import LocalBackend
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.model_runner import ModelRunner
    from pipeline.models import MODEL_DIRNAME

    torch.set_num_threads(settings.runtime.torch_threads)
    path = settings.model_cache / MODEL_DIRNAME
    spec = settings.backends[0]
    config = EngineConfig(max_num_seqs=spec.max_batch, dtype=spec.dtype, **overrides)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return {spec.name: LocalBackend(ModelRunner.from_path(path, config), tokenizer, name=spec.name, engine_config=config)}


async def measure(settings: Settings, args: argparse.Namespace) -> None:
    trace = StepTrace.install() if args.step_trace else None
    await kafka.create_topics(settings)
    stop = asyncio.Event()
    overrides = engine_overrides(args)
    backends = local_backend(settings, overrides) if overrides else backend_registry.load(settings)
    stages = assemble.build(assemble.nodes_of(settings), settings, backends, worker="bench")
    producer = Producer(settings, "sluice-stages-bench")  # as `sluice run` wires them (handover included)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, "bench")
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    await asyncio.wait_for(asyncio.gather(*(r.ready.wait() for r in runners)), 120)
    texts = prompts(args.prompts, args.prompt_chars)
    with tempfile.TemporaryDirectory() as tmp:
        async with Client(settings) as client:
            backfill = Backfill(settings, client, Path(tmp))
            worker = asyncio.create_task(backfill.worker.run(stop))
            await client.complete(messages=[{"role": "user", "content": "warm up"}], max_tokens=4)

            started = time.perf_counter()
            tokens = 0
            for text in texts:
                answer = await client.complete(messages=[{"role": "user", "content": text}], max_tokens=args.max_tokens)
                tokens += answer.done.usage.completion_tokens
            interactive_s = time.perf_counter() - started
            interactive_tps = tokens / interactive_s
            print(f"interactive one at a time: {tokens} tokens in {interactive_s:.1f} s = {interactive_tps:.1f} tokens/s", flush=True)

            started = time.perf_counter()
            job = await backfill.wait(await backfill.submit(jsonl(texts, args.max_tokens)))
            backfill_s = time.perf_counter() - started
            batch_tokens = backfill.completion_tokens(job)
            backfill_tps = batch_tokens / backfill_s
            print(f"backfill ({job.status.value}): {batch_tokens} tokens in {backfill_s:.1f} s = {backfill_tps:.1f} tokens/s", flush=True)
            alone_tps = await engine_alone(backends, texts, args.max_tokens, settings.batch.max_in_flight)
            print(f"engine alone, the same prompts {settings.batch.max_in_flight} at once: {alone_tps:.1f} tokens/s "
                  f"(the backfill {backfill_tps / alone_tps:.2f}x of it)", flush=True)

            idle: list[float] = []
            busy: list[float] = []
            finished = 0
            windows: dict[str, list[tuple[float, float]]] = {"idle": [], "busy": []}
            for mode in block_order(args.blocks):  # idle, busy, busy, idle, ...: drift on the host falls on both
                n = args.probes // args.blocks
                if mode == "idle":
                    started = time.perf_counter()
                    idle += await probe(client, n, args.probe_tokens)
                    windows[mode].append((started, time.perf_counter()))
                else:
                    latencies, lines, window = await busy_block(backfill, client, texts, args, n, backends)
                    busy += latencies
                    finished += lines
                    windows[mode].append(window)
            print(f"probes idle: p50 {percentile(idle, 50):.0f} ms, p99 {percentile(idle, 99):.0f} ms", flush=True)
            print(f"probes during a backfill: p50 {percentile(busy, 50):.0f} ms, p99 {percentile(busy, 99):.0f} ms "
                  f"({finished} backfill lines finished meanwhile)", flush=True)
            stop.set()
            await worker
            await backfill.store.aclose()
    await asyncio.gather(*tasks)
    await producer.stop()
    if trace is not None:
        for mode, label in (("idle", "probes idle"), ("busy", "probes during a backfill")):
            for window in windows[mode]:
                print(trace.summary(*window, label))
        for phase in ("idle", "busy"):  # the slowest probes of each phase: which steps they spanned
            slowest = sorted((w for w in WINDOWS if w[2] == phase), key=lambda w: w[0] - w[1])[:5]
            for start, end, _ in slowest:
                print(f"  slowest {phase} probe {1000 * (end - start):.0f} ms: {trace.within(start, end)}")
    b = settings.batch
    print(f"\n| what | figure |\n| --- | --- |\n"
          f"| interactive, one at a time ({len(texts)} prompts of at most {args.prompt_chars} characters, max_tokens {args.max_tokens}) | {interactive_tps:.1f} tokens/s |\n"
          f"| backfill, the same prompts (batch lane, max_in_flight {b.max_in_flight}, max_batch "
          f"{settings.backends[0].max_batch}, torch_threads {settings.runtime.torch_threads}, dtype {settings.backends[0].dtype}, engine {overrides or 'defaults'}) | {backfill_tps:.1f} tokens/s ({backfill_tps / interactive_tps:.2f}x) |\n"
          f"| the engine alone, the same prompts, {b.max_in_flight} at once (no Kafka, no stages) | {alone_tps:.1f} tokens/s "
          f"(the backfill {backfill_tps / alone_tps:.2f}x of it) |\n"
          f"| interactive p50 / p99, idle ({len(idle)} probes in {args.blocks} block(s), max_tokens {args.probe_tokens}) | "
          f"{percentile(idle, 50):.0f} / {percentile(idle, 99):.0f} ms |\n"
          f"| interactive p50 / p99, during a backfill ({'distinct prompts' if args.distinct_load else 'the same prompts x8'}) | {percentile(busy, 50):.0f} / {percentile(busy, 99):.0f} ms "
          f"({percentile(busy, 99) / percentile(idle, 99):.2f}x the idle p99) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=300, help="each ShareGPT prompt cut to this many characters")
    parser.add_argument("--distinct-load", action="store_true",
                        help="busy blocks back-fill 8x as many other prompts (default: the same prompts 8 times)")
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--probe-tokens", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1, help="probe phases per mode, interleaved ABBA (idle, busy, busy, idle, ...)")
    parser.add_argument("--max-in-flight", type=int, default=None, help="batch.max_in_flight (default: the config's)")
    parser.add_argument("--batch-every", type=int, default=None, help="the engine's batch_every (default: EngineConfig's)")
    parser.add_argument("--handoff-hold-ms", type=float, default=None, help="the engine's handoff_hold_ms (default: EngineConfig's)")
    parser.add_argument("--batch-prompt-tokens", type=int, default=None,
                        help="the engine's batch_prompt_tokens (default: EngineConfig's; 0: no cap)")
    parser.add_argument("--shared-prompt-tokens", type=int, default=None,
                        help="the engine's shared_prompt_tokens (default: EngineConfig's; 0: batch_prompt_tokens applies)")
    parser.add_argument("--interrupt-within", type=float, default=None,
                        help="the engine's interrupt_batch_steps: the share of a batch-only step's layers within which "
                             "an interactive arrival stops it (default: EngineConfig's; 0: never)")
    parser.add_argument("--step-trace", action="store_true", help="print the engine's steps while the probes ran")
    parser.add_argument("--torch-threads", type=int, default=None, help="runtime.torch_threads (default: the config's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="the local backend's weights (default: the config's)")
    args = parser.parse_args()
    with own_services("bench-backfill", 18192, 18479) as env:
        settings = settings_module.load(env=env)
        batch = settings.batch if args.max_in_flight is None else replace(settings.batch, max_in_flight=args.max_in_flight)
        runtime = settings.runtime if args.torch_threads is None else replace(settings.runtime, torch_threads=args.torch_threads)
        backends = settings.backends if args.dtype is None else (replace(settings.backends[0], dtype=args.dtype), *settings.backends[1:])
        settings = replace(settings, profile="bare", cache=replace(settings.cache, enabled=False),
                           batch=replace(batch, admission_rps=0.0), runtime=runtime, backends=backends)
        asyncio.run(measure(settings, args))


if __name__ == "__main__":
    main()

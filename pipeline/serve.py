"""Runs stages (and optionally the bridge) in this process until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable

import uvloop

from pipeline.gateway.redact import RedactKeys
from pipeline.handling import Handling
from pipeline.handover import LocalReplies
from pipeline.logs import RateLimit
from pipeline.producing import Producer
from pipeline.runner import Runner
from pipeline.settings import Settings
from pipeline.stage import Stage
from pipeline.topology import GENERATE, HANDOVER, HANDOVER_FROM
from topics import registry

log = logging.getLogger(__name__)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # aiokafka's DEBUG records carry message payloads; HTTP clients may log a request's full URL (httpx does
    # at INFO), and an upstream's (base_url, jwks_url, the OTLP endpoint) may hold a key in its query string
    for name in ("aiokafka", "kafka", "httpx", "httpcore", "aiohttp"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RateLimit())  # first: a dropped line is not formatted for redaction
        handler.addFilter(RedactKeys())


async def run_stages(
    stages: list[Stage], settings: Settings, stop: asyncio.Event, *, instance: str = "0", replies: LocalReplies | None = None,
    local_requests: bool = False,
) -> None:
    """Runs one runner per stage until `stop` is set; a runner that crashes stops the others. The
    runners share one producer. `replies`: the SDK client of a bridge in this process; with
    `local_requests` it sends its requests to the partitions this process's ingest reads."""
    producer = Producer(settings, f"sluice-stages-{instance}", lingering=registry.LINGERING)
    await producer.start(stop)
    runners = runners_for(stages, settings, producer, instance, replies, local_requests=local_requests)
    tasks = [asyncio.create_task(r.run(stop), name=r.stage.name) for r in runners]
    log.info("running stages: %s", ", ".join(s.name for s in stages))
    settling = asyncio.create_task(_settle_when_ready(runners, settings))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                log.error("stage %s crashed: %r", task.get_name(), task.exception())
                stop.set()
    finally:
        stop.set()
        settling.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await producer.stop()
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    if errors:
        raise errors[0]


async def _settle_when_ready(runners: list[Runner], settings: Settings) -> None:
    await asyncio.gather(*(runner.ready.wait() for runner in runners))
    settle_gc(settings)


def settle_gc(settings: Settings) -> None:
    """Called once a process has started: what it loaded (modules, models, clients) is frozen out of the
    garbage collector's walks, and the youngest generation is collected every `runtime.gc_threshold` net
    allocations instead of 700. Most of a request's objects die by reference count, so collections were
    mostly walks over survivors: 0.28-0.35 ms of CPU a request in the bare pipeline, under 0.01 ms after
    (docs/benchmarks.md, "Session 21: the garbage collector")."""
    if settings.runtime.gc_threshold and not gc.get_freeze_count():
        gc.collect()
        gc.freeze()
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(settings.runtime.gc_threshold, older, oldest)


def runners_for(
    stages: list[Stage], settings: Settings, producer: Producer, instance: str, replies: LocalReplies | None = None, *,
    local_requests: bool = False,
) -> list[Runner]:
    """A runner per stage, sharing `producer`; with `runtime.handover`, the request-part stages after
    ingest (guard, cache, route) take their input from the stages of this process in memory, and so do
    emit from the cache and generate stages and generate from route (`topology.HANDOVER_FROM`), and the
    bridge's client (`replies`) the replies emit has for its streams."""
    handlings = {stage.name: Handling(stage, settings, producer) for stage in stages}
    if settings.runtime.handover:
        for name, handling in handlings.items():
            if _kind(name) == "emit":
                handling.replies = replies
        takers = {stage.topics.inputs[0]: handlings[stage.name] for stage in stages if stage.name in HANDOVER}
        for name, handling in handlings.items():
            handling.takers = takers | {
                taker.stage.topics.inputs[0]: taker for taker in handlings.values()
                if _kind(name) in HANDOVER_FROM.get(_kind(taker.stage.name), ())
            }
            if _kind(name) == GENERATE:
                # Its work lasts a whole stream, all that time holding the in-flight slot of the message
                # that started the chain (ingest's): half of them at most, the rest through its topic,
                # so long streams never stop ingest admitting (cache hits, refusals).
                handling.take_limit = max(1, settings.runtime.max_in_flight // 2)
    runners = [Runner(stage, settings, instance=instance, producer=producer, handling=handlings[stage.name]) for stage in stages]
    ingest = next((r for r in runners if r.stage.name == "ingest"), None)
    if local_requests and replies is not None and settings.runtime.handover and ingest is not None:
        # With a bridge in every process only: one bridge sending all its requests to its own process
        # would leave the others idle. Here each request's chain runs in memory, answer included.
        replies.send_requests_to(ingest.partitions)
    if settings.runtime.handover:  # a taker closes its connections after every runner that may hand it work
        for runner in runners:
            if runner.stage.name in HANDOVER or _kind(runner.stage.name) in HANDOVER_FROM:
                runner.close_after = tuple(other.drained for other in runners if other is not runner)
    return runners


def _kind(name: str) -> str:
    """A stage's kind: its name without the pool (`generate.<pool>`)."""
    return name.split(".")[0]


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """main(stop) on a uvloop event loop, where SIGINT/SIGTERM set `stop` for a graceful shutdown."""

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(wrapper())

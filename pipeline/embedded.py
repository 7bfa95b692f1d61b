"""`sluice run --in-process`: every stage of the profile and the bridge in one process, on the local
Kafka and Redis (`sluice run` supervises it: pipeline/supervisor.py); `sluice bridge`: the bridge alone,
in front of stage processes started elsewhere (`sluice worker`)."""

from __future__ import annotations

import asyncio
import logging

from pipeline import kafka, serve
from pipeline.observability import setup as observability
from pipeline.process import run_stages
from pipeline.settings import Settings

log = logging.getLogger(__name__)


async def _main(settings: Settings, stop: asyncio.Event, *, with_stages: bool = True) -> None:
    from pipeline.bridge import serve as serve_bridge
    from pipeline.sdk import Client

    await kafka.create_topics(settings)
    client = Client(settings, reply_name=settings.bridge.reply_name, client_id="sluice-bridge")
    await client.start()
    try:
        tasks = {asyncio.create_task(serve_bridge(settings, client, stop))}
        if with_stages:
            tasks.add(asyncio.create_task(run_stages(None, settings, stop, client)))  # settles the GC once its stages run
        else:
            serve.settle_gc(settings)
        log.info("bridge on http://%s:%d", settings.bridge.host, settings.bridge.port)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        # every task to its end (the stages close their producers) before the first failure is raised
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    finally:
        await client.stop()


def run_embedded(settings: Settings, *, with_stages: bool = True) -> None:
    serve.configure_logging()
    observability.install(settings)
    serve.run_until_signal(lambda stop: _main(settings, stop, with_stages=with_stages))

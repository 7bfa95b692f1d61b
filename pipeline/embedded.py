"""`sluice run --in-process`: every stage of the profile and the bridge in one process, on the local
Kafka and Redis (`sluice run` supervises it: pipeline/supervisor.py; with `--shared-port` each of its
processes is one of these, on one port); `sluice bridge`: the bridge alone, in front of stage processes
started elsewhere (`sluice worker`)."""

from __future__ import annotations

import asyncio
import logging

from pipeline import kafka, serve
from pipeline.observability import setup as observability
from pipeline.observability.siblings import Siblings
from pipeline.process import run_stages
from pipeline.settings import Settings

log = logging.getLogger(__name__)


async def _main(settings: Settings, stop: asyncio.Event, *, with_stages: bool = True, shared_port: bool = False) -> None:
    from pipeline.bridge import serve as serve_bridge
    from pipeline.bridge.dashboard import snapshot
    from pipeline.sdk import Client

    await kafka.create_topics(settings)
    client = Client(settings, reply_name=settings.bridge.reply_name, client_id="sluice-bridge")
    await client.start()
    siblings = Siblings.from_env(snapshot) if shared_port else None  # `sluice run`'s other processes on the port
    try:
        if siblings is not None:
            await siblings.start()
        tasks = {asyncio.create_task(serve_bridge(settings, client, stop, shared_port=shared_port, siblings=siblings))}
        if with_stages:
            tasks.add(asyncio.create_task(run_stages(None, settings, stop, client, local_requests=shared_port)))  # settles the GC once its stages run
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
        if siblings is not None:
            await siblings.stop()
        await client.stop()


def run_embedded(settings: Settings, *, with_stages: bool = True, shared_port: bool = False) -> None:
    serve.configure_logging()
    observability.install(settings)
    serve.run_until_signal(lambda stop: _main(settings, stop, with_stages=with_stages, shared_port=shared_port))

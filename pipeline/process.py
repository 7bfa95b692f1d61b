"""One sluice process: loads the backends its stages need, builds the stages, runs them until a signal.
The body of every `workers/<stage>.py`, of `sluice worker` and of `sluice run`."""

from __future__ import annotations

import asyncio
import logging
import os

from pipeline import assemble, serve
from pipeline import backends as backend_registry
from pipeline import settings as settings_module
from pipeline.handover import LocalReplies
from pipeline.observability import setup as observability
from pipeline.settings import Settings

log = logging.getLogger(__name__)


async def run_stages(
    names: list[str] | None, settings: Settings, stop: asyncio.Event, replies: LocalReplies | None = None, *, local_requests: bool = False,
) -> None:
    """Runs the profile's stages named (by kind, `decode`, or by name, `decode.local`); None: all of them.
    `replies`: the SDK client of a bridge in this process (emit delivers its streams' replies in memory);
    `local_requests`: it sends its requests to this process's ingest (a bridge in every process)."""
    nodes = assemble.nodes_of(settings, names)
    pools = frozenset(n.pool for n in nodes if n.pool is not None)
    backends = await asyncio.to_thread(backend_registry.load, settings, pools) if pools else {}
    try:
        if stop.is_set():  # a signal came while the models loaded: nothing started, nothing to drain
            return
        stages = assemble.build(nodes, settings, backends, worker=str(os.getpid()))
        await serve.run_stages(stages, settings, stop, instance=str(os.getpid()), replies=replies, local_requests=local_requests)
    finally:  # the stages have stopped: the backends' connections and engines go too
        closed = await asyncio.gather(*(b.aclose() for b in backends.values()), return_exceptions=True)
        for name, result in zip(backends, closed, strict=True):
            if isinstance(result, Exception):
                log.warning("backend %s failed to close (%s)", name, type(result).__name__)


def run_worker(*names: str) -> None:
    serve.configure_logging()
    settings = settings_module.load()
    observability.install(settings, serve_metrics=True)
    serve.run_until_signal(lambda stop: run_stages(list(names) or None, settings, stop))

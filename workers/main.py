"""Runs named stages in one process: the body of every `workers/<stage>.py` and of `sluice run`."""

from __future__ import annotations

import asyncio
import os

from pipeline import backends as backend_registry
from pipeline import serve, settings as settings_module, tracing
from pipeline.settings import Settings
from workers import topology


async def run_stages(names: list[str], settings: Settings, stop: asyncio.Event) -> None:
    needed = any(n in topology.NEEDS_BACKEND for n in names)
    backends = await asyncio.to_thread(backend_registry.load, settings) if needed else {}
    stages = topology.build(names, settings, backends)
    await serve.run_stages(stages, settings, stop, instance=str(os.getpid()))


def run_worker(*names: str) -> None:
    serve.configure_logging()
    tracing.install()
    settings = settings_module.load()
    serve.run_until_signal(lambda stop: run_stages(list(names), settings, stop))

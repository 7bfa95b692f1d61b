"""The cache against the real pipeline and services: a streamed hit through the bridge replays the same
server-sent events, `Cache-Control` is obeyed, a purge reaches both tiers, and Redis going away or
losing its data costs misses, never errors or wrong answers."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pipeline.cache import keys
from pipeline.cache.exact import RedisExactTier
from pipeline.cache.purge_cli import run as purge
from pipeline.gateway.build import stage_redis
from pipeline.settings import RedisSettings, Settings
from tests.integration.conftest import Bridge
from tests.ports import free_port
from topics.cache import Entry

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _question() -> list[dict[str, str]]:
    # Unique per run: the services (and Redis' entries) may outlive a test session.
    return [{"role": "user", "content": f"Name a fruit that is red. My order number is {uuid.uuid4().int % 10**8}."}]


async def _sse(http: httpx.AsyncClient, body: dict[str, object], headers: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(x-sluice-cache, the data lines with the per-response id and timestamp blanked)."""
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        tier = response.headers["x-sluice-cache"]
    blanked = [re.sub(r'"id":"[^"]+"|"created":\d+', "", line) for line in lines]
    return tier, blanked


async def _until_hit(http: httpx.AsyncClient, body: dict[str, object]) -> tuple[str, list[str]]:
    """Asks until the answer is served from the cache (emit stores it after the terminal event)."""
    for _ in range(50):
        tier, lines = await _sse(http, body)
        if tier != "miss":
            return tier, lines
        await asyncio.sleep(0.1)
    raise AssertionError("the answer was never served from the cache")


async def test_a_streamed_hit_replays_the_same_events_through_the_bridge(bridge: Bridge) -> None:
    body = {"model": bridge.settings.models[0], "messages": _question(), "max_tokens": 12, "stream": True}
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        tier, first = await _sse(http, body)
        assert tier == "miss"
        tier, replay = await _until_hit(http, body)
    assert tier == "hit-exact"
    assert replay == first and replay[-1] == "data: [DONE]"


async def test_cache_control_no_cache_and_no_store_are_obeyed(bridge: Bridge) -> None:
    body = {"model": bridge.settings.models[0], "messages": _question(), "max_tokens": 8, "stream": False}
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        stored = await http.post("/v1/chat/completions", json=body, headers={"cache-control": "no-store"})
        assert stored.status_code == 200 and stored.headers["x-sluice-cache"] == "miss"
        await asyncio.sleep(0.5)
        assert (await http.post("/v1/chat/completions", json=body)).headers["x-sluice-cache"] == "miss"  # not stored before
        tier, _ = await _until_hit(http, {**body, "stream": True})
        assert tier == "hit-exact"
        again = await http.post("/v1/chat/completions", json=body, headers={"cache-control": "no-cache"})
        assert again.headers["x-sluice-cache"] == "miss"
        whole = await http.post("/v1/chat/completions", json=body)
        assert whole.headers["x-sluice-cache"] == "hit-exact" and json.loads(whole.content)["choices"][0]["message"]["content"]


async def test_a_purge_empties_both_tiers_for_the_tenant(bridge: Bridge) -> None:
    body = {"model": bridge.settings.models[0], "messages": _question(), "max_tokens": 8, "stream": True}
    async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
        await _sse(http, body)
        await _until_hit(http, body)

        class Args:
            tenant, model = "default", None

        assert await purge(bridge.settings, Args()) == 0  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # the cache workers read the purge record
        assert (await _sse(http, body))[0] == "miss"


def _redis(port: int, state: Path) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(state)], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    return process


async def test_the_exact_tier_loses_its_entries_with_redis_but_never_fails(stack: Settings, tmp_path: Path) -> None:
    port = free_port()
    settings = Settings(redis=RedisSettings(url=f"redis://127.0.0.1:{port}/0"))
    entry = Entry(key=keys.scope("t") + "k", tenant="t", model="m", context="c", chunks=("a", "b"), finish_reason="stop",
                  prompt_tokens=3, completion_tokens=2, stored_at=time.time(), expires_at=time.time() + 60)
    server = _redis(port, tmp_path)
    exact = RedisExactTier(stage_redis(settings))  # the client the cache stage runs on
    try:
        await exact.put(entry)
        assert await exact.get(entry.key) == entry
        server.terminate()
        server.wait()
        assert await exact.get(entry.key) is None  # Redis away: a miss, not an error
        await exact.put(entry)  # and storing is skipped
        server = _redis(port, tmp_path)
        assert await exact.get(entry.key) is None  # restarted empty: lost, never a wrong answer
        await exact.put(entry)
        assert await exact.get(entry.key) == entry
    finally:
        await exact.aclose()
        server.terminate()
        server.wait()

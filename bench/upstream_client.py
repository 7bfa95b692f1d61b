"""What calling an OpenAI-compatible upstream costs per request: the openai backend (aiohttp, kept-alive
connections; streamed, and whole with `stream_upstream = false`) against the backend as commit --before
had it (httpx, a stream read to `[DONE]`, so a new connection per request; loaded from git), on the same
upstream, each driven through its `generate`.

    .venv/bin/python -m bench.upstream_client                      # 1,000 requests per case, 3 rounds
    .venv/bin/python -m bench.upstream_client --requests 2000 --concurrency 16

The fake upstream (bench.fake_openai, 16 words per answer) runs in a process of its own; this process
sends the requests. Reported per case, median (min..max) over rounds, the cases' order rotating each
round: CPU microseconds per request of this process (the client) and of the upstream, wall time per
request, and the connections the upstream saw opened.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench.stats import spread
from pipeline.backends.base import GenerationRequest, Message
from pipeline.backends.openai_compat import OpenAIBackend
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

WORDS = 16


def ask(i: int, stream: bool) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", messages=(Message("user", "hello there"),), max_tokens=WORDS, stream=stream)


def backend_before(rev: str) -> type:
    """The backend's class as commit `rev` had it (httpx, a stream read to `[DONE]`, so a new connection
    per request), loaded from git."""
    source = subprocess.run(["git", "show", f"{rev}:pipeline/backends/openai_compat.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="upstream-client-")) / "openai_compat_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("openai_compat_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OpenAIBackend  # type: ignore[no-any-return]


def backend_case(make: Callable[[str], Any]) -> Callable[[str, int, int], Awaitable[None]]:
    async def run(base_url: str, requests: int, concurrency: int) -> None:
        backend = make(base_url)

        async def one(i: int) -> None:
            async for _ in backend.generate(ask(i, stream=False)):
                pass

        await bounded(one, requests, concurrency)
        await backend.aclose()
    return run


async def bounded(one: Callable[[int], Awaitable[None]], requests: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> None:
        async with gate:
            await one(i)

    await asyncio.gather(*(gated(i) for i in range(requests)))


def cases(before: str) -> dict[str, Callable[[str, int, int], Awaitable[None]]]:
    old = backend_before(before)
    return {
        f"before ({before}: httpx, a connection per request)": backend_case(lambda url: old("bench", url, "m")),
        "openai backend, streamed (default)": backend_case(lambda url: OpenAIBackend("bench", url, "m")),
        "openai backend, whole (stream_upstream = false)": backend_case(lambda url: OpenAIBackend("bench", url, "m", stream_upstream=False)),
    }


def connections(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats") as reply:
        return int(json.loads(reply.read())["connections"])


async def measure(args: argparse.Namespace) -> None:
    port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "bench.fake_openai", "--port", str(port)])
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(100):
            try:
                connections(port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        server = psutil.Process(upstream.pid)
        run = cases(args.before)
        figures: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in run}
        names = list(run)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                opened = connections(port)
                client0, server0, wall0 = time.process_time(), sum(server.cpu_times()[:2]), time.perf_counter()
                await run[name](base_url, args.requests, args.concurrency)
                client1, server1, wall1 = time.process_time(), sum(server.cpu_times()[:2]), time.perf_counter()
                n = args.requests
                figures[name].append((1e6 * (client1 - client0) / n, 1e6 * (server1 - server0) / n, 1e6 * (wall1 - wall0) / n,
                                      connections(port) - opened))
    finally:
        upstream.terminate()
        upstream.wait()
    print(f"\n{args.requests} requests per case, {args.concurrency} at a time, {args.rounds} rounds; {WORDS} words per answer, "
          "the client not streaming; median (min..max)\n")
    print("| case | client CPU us/request | upstream CPU us/request | wall us/request | connections opened |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in figures.items():
        cells = [spread([row[k] for row in rows], ",.0f") for k in range(3)]
        print(f"| {name} | {' | '.join(cells)} | {spread([row[3] for row in rows], ',.0f')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default="b3eb2d0", help="the commit whose backend is the 'before' case")
    uvloop.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()

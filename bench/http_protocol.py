"""The bridge's HTTP layer alone: uvicorn's h11 protocol (pure Python; the bridge's until session 30)
against the bridge's protocol, uvicorn's httptools one (llhttp, in C) with sluice's deadline and size
bound on each request head (`pipeline.bridge.edges.head_limited_protocol`), under the same load.

    .venv/bin/python -m bench.http_protocol                       # 300 requests/s, 8 s a step, 4 repeats
    .venv/bin/python -m bench.http_protocol --rate 600 --repeats 6

Each protocol serves, in a process of its own on uvloop, a Starlette route shaped like the bridge's
chat completions endpoint without the pipeline behind it: it reads the JSON body of a chat request,
decodes it, and answers a chat completion of the size the throughput benchmark's requests get. The load
is bench/http_load.py's lean keep-alive client, open loop. Steps alternate between the two servers and
the order flips on every repeat. Reported per step: requests answered, latency p50/p99, and the server
process's CPU per request (/proc: user + system time over the step). What this leaves out: the bridge's
own middleware and routing (the same under either protocol) and everything behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.http_load import Pool, paced_posts
from bench.kafka_hop import cpu_seconds
from bench.stats import percentile

PROTOCOLS = ("h11", "httptools")  # uvicorn's h11; the bridge's (httptools, with its head limits)
PATH = "/v1/chat/completions"
BODY = json.dumps({"model": "instant", "max_tokens": 16, "messages": [
    {"role": "user", "content": "Request 0123456789ab: tell me something about the number 7."}]}).encode()


def app():  # type: ignore[no-untyped-def]
    import msgspec
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    message = {"role": "assistant", "content": " ".join(f"t{i}" for i in range(16))}
    answer = msgspec.json.encode({
        "id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": 1_700_000_000, "model": "instant",
        "choices": [{"index": 0, "finish_reason": "length", "message": message}],
        "usage": {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40},
    })

    async def completions(request: Request) -> Response:
        msgspec.json.decode(await request.body())
        return Response(answer, media_type="application/json")

    return Starlette(routes=[Route(PATH, completions, methods=["POST"])])


def serve(protocol: str, port: int) -> None:
    import uvicorn

    from pipeline.bridge.app import MAX_HEADER_BYTES
    from pipeline.bridge.edges import head_limited_protocol

    http = "h11" if protocol == "h11" else head_limited_protocol(10.0, MAX_HEADER_BYTES)
    uvicorn.run(app(), host="127.0.0.1", port=port, loop="uvloop", http=http, log_level="warning", access_log=False,
                h11_max_incomplete_event_size=MAX_HEADER_BYTES, lifespan="off")


async def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def step(pool: Pool, pid: int, rate: float, seconds: float) -> dict[str, float]:
    bodies = [BODY] * int(rate * seconds)
    before = cpu_seconds(pid)
    outcomes = await paced_posts(pool, PATH, bodies, rate)
    used = cpu_seconds(pid) - before
    ok = [o.latency_ms for o in outcomes if o.status == 200]
    return {"ok": len(ok), "sent": len(bodies), "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
            "cpu_us_per_request": 1e6 * used / max(len(ok), 1)}


async def main(args: argparse.Namespace) -> None:
    servers = {}
    for i, protocol in enumerate(PROTOCOLS):
        port = args.port + i
        servers[protocol] = (port, subprocess.Popen([sys.executable, "-m", "bench.http_protocol", "--serve", protocol,
                                                     "--port", str(port)], cwd=Path(__file__).resolve().parent.parent))
    results: list[dict[str, object]] = []
    try:
        pools = {}
        for protocol, (port, _) in servers.items():
            await wait_listening(port)
            pools[protocol] = Pool("127.0.0.1", port)
            await paced_posts(pools[protocol], PATH, [BODY] * int(args.rate * 2), args.rate)  # warm-up
        print("| protocol | repeat | ok/sent | p50 ms | p99 ms | server CPU µs per request |")
        print("| --- | --- | --- | --- | --- | --- |")
        for repeat in range(args.repeats):
            order = PROTOCOLS if repeat % 2 == 0 else PROTOCOLS[::-1]
            for protocol in order:
                row = await step(pools[protocol], servers[protocol][1].pid, args.rate, args.seconds)
                results.append({"protocol": protocol, "repeat": repeat, **row})
                print(f"| {protocol} | {repeat} | {row['ok']}/{row['sent']} | {row['p50_ms']:.2f} "
                      f"| {row['p99_ms']:.2f} | {row['cpu_us_per_request']:.0f} |", flush=True)
                await asyncio.sleep(args.pause)
        for protocol in PROTOCOLS:
            cpu = sorted(float(r["cpu_us_per_request"]) for r in results if r["protocol"] == protocol)  # type: ignore[arg-type]
            print(f"{protocol}: server CPU per request median {percentile(cpu, 50):.0f} µs "
                  f"(min {cpu[0]:.0f}, max {cpu[-1]:.0f})")
    finally:
        for _, process in servers.values():
            process.terminate()
            process.wait(10)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--pause", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=19800)
    parser.add_argument("--out", default="")
    parser.add_argument("--serve", choices=PROTOCOLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        serve(args.serve, args.port)
    else:
        asyncio.run(main(args))

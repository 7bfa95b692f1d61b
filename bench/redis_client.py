"""CPU per Redis round trip through redis-py's asyncio client, with its pure-Python reply parser and with
hiredis's C parser (what `make setup` installs), and through `pipeline.redis_lean.LeanRedis` (one pipelined
connection, hiredis; what the stages' stores use), on the calls sluice's stores make: HGETALL of a
request's record, GET, EVALSHA of a small script, a pipelined HSET + EXPIRE, and 16 HGETALLs in flight.

    .venv/bin/python -m bench.redis_client                # 3 repeats, the clients interleaved

Starts its own redis-server (Debian's, as infra/services.sh does) on --port, without persistence. Each
measurement runs in a process of its own on uvloop; reported as µs of CPU per call, median (min..max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time

CALLS = ("hgetall", "get", "evalsha", "pipeline", "hgetall x16")
CLIENTS = ("python", "hiredis", "lean")
SCRIPT = "local v = redis.call('HGET', KEYS[1], 'owner') redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return v"


async def measure(port: int, client: str, n: int) -> dict[str, float]:
    from redis.asyncio import Redis
    from redis.asyncio.connection import _AsyncHiredisParser, _AsyncRESP2Parser

    from pipeline.redis_lean import LeanRedis

    if client == "lean":
        r: Redis | LeanRedis = LeanRedis(port=port)
    else:
        r = Redis.from_url(f"redis://127.0.0.1:{port}/0", parser_class=_AsyncHiredisParser if client == "hiredis" else _AsyncRESP2Parser)
    async with r.pipeline(transaction=False) as pipe:
        await pipe.hset("req#emit", items=["owner", b"emit-1-abc", "emitted", b"3", "digest", b"x" * 32, "terminal", b"1"]).execute()
    sha = await r.script_load(SCRIPT)
    calls = {
        "hgetall": lambda i: r.hgetall("req#emit"),
        "get": lambda i: r.get("cache:key"),
        "evalsha": lambda i: r.evalsha(sha, 1, "req#emit", "f", i),
        "pipeline": lambda i: r.pipeline(transaction=False).hset("req", items=["f", i]).pexpire("req", 3_600_000).execute(),
    }
    out = {}
    for name in CALLS:
        for _ in range(2):  # the first pass warms the connection pool and the code paths
            started = time.process_time()
            if name == "hgetall x16":
                for _ in range(n // 16):
                    await asyncio.gather(*(r.hgetall("req#emit") for _ in range(16)))
            else:
                for i in range(n):
                    await calls[name](i)
            out[name] = (time.process_time() - started) / n * 1e6
    await r.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=46999)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(measure(args.port, args.child, args.calls))))
        return
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(args.port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        results: dict[str, dict[str, list[float]]] = {client: {} for client in CLIENTS}
        for repeat in range(args.repeats):
            for mode in (CLIENTS if repeat % 2 == 0 else CLIENTS[::-1]):
                child = subprocess.run([sys.executable, "-m", "bench.redis_client", "--child", mode, "--port", str(args.port),
                                        "--calls", str(args.calls)], check=True, capture_output=True, text=True)
                for key, value in json.loads(child.stdout.strip().splitlines()[-1]).items():
                    results[mode].setdefault(key, []).append(value)
    finally:
        server.terminate()
        server.wait()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})"

    print(f"\n{args.calls} calls per measurement, {args.repeats} runs per client, µs of CPU per call: median (min..max)\n")
    print("| call | redis-py, pure-Python parser | redis-py, hiredis | LeanRedis | LeanRedis / redis-py hiredis |")
    print("| --- | --- | --- | --- | --- |")
    for name in CALLS:
        py, hi, lean = (results[client][name] for client in CLIENTS)
        print(f"| {name} | {cell(py)} | {cell(hi)} | {cell(lean)} | {statistics.median(lean) / statistics.median(hi):.2f} |")


if __name__ == "__main__":
    main()

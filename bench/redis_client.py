"""CPU per Redis round trip through redis-py's asyncio client, with its pure-Python reply parser and with
hiredis's C parser (what `make setup` installs), and through `pipeline.redis_lean.LeanRedis` (one pipelined
connection, hiredis; what the stages' stores use), on the calls sluice's stores make: HGETALL of a
request's record, GET, EVALSHA of a small script, a pipelined HSET + EXPIRE, and 16 HGETALLs in flight.

    .venv/bin/python -m bench.redis_client                # 3 repeats, the clients interleaved
    .venv/bin/python -m bench.redis_client --before REV   # and LeanRedis as it was at commit REV

With --before, a fourth client (`lean-before`) runs LeanRedis from a git worktree of REV (under
.cache/bench, as bench.throughput makes). Besides the client's CPU per call, the table gives the Redis
server's CPU per call over a client's whole run (every kind of call, warm-up passes included).

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

import psutil

from bench.stats import spread
from bench.throughput import before_tree

CALLS = ("hgetall", "get", "evalsha", "pipeline", "hgetall x16")
CLIENTS = ("python", "hiredis", "lean", "lean-before")
SCRIPT = "local v = redis.call('HGET', KEYS[1], 'owner') redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return v"


async def measure(port: int, client: str, n: int) -> dict[str, float]:
    from redis.asyncio import Redis
    from redis.asyncio.connection import _AsyncHiredisParser, _AsyncRESP2Parser

    from pipeline.redis_lean import LeanRedis

    if client in ("lean", "lean-before"):  # lean-before runs in the --before worktree: its own module
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
    parser.add_argument("--port", type=int, default=16999)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="", help="also measure LeanRedis as it was at this commit")
    parser.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--tree", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        if args.tree:  # lean-before: the commit's own pipeline package, imported before ours can be
            assert "pipeline" not in sys.modules
            sys.path.insert(0, args.tree)

        print(json.dumps(uvloop.run(measure(args.port, args.child, args.calls))))
        return
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(args.port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        clients = CLIENTS if args.before else CLIENTS[:-1]
        trees = {client: "" for client in clients}
        if args.before:
            trees["lean-before"] = before_tree(args.before)
        results: dict[str, dict[str, list[float]]] = {client: {} for client in clients}
        redis = psutil.Process(server.pid)
        for repeat in range(args.repeats):
            for mode in (clients if repeat % 2 == 0 else clients[::-1]):
                cpu = redis.cpu_times()
                child = subprocess.run([sys.executable, "-m", "bench.redis_client", "--child", mode, "--port", str(args.port),
                                        "--calls", str(args.calls), "--tree", str(trees[mode])],
                                       check=True, capture_output=True, text=True)
                after = redis.cpu_times()
                calls = 2 * args.calls * len(CALLS)  # two passes of each kind
                server_us = (after.user + after.system - cpu.user - cpu.system) / calls * 1e6
                results[mode].setdefault("server", []).append(server_us)
                for key, value in json.loads(child.stdout.strip().splitlines()[-1]).items():
                    results[mode].setdefault(key, []).append(value)
    finally:
        server.terminate()
        server.wait()

    print(f"\n{args.calls} calls per measurement, {args.repeats} runs per client, µs of CPU per call: median (min..max)\n")
    before = f" | LeanRedis at {args.before} | LeanRedis / at {args.before}" if args.before else ""
    print(f"| call | redis-py, pure-Python parser | redis-py, hiredis | LeanRedis | LeanRedis / redis-py hiredis{before} |")
    print("| --- | --- | --- | --- | --- |" + (" --- | --- |" if args.before else ""))
    for name in (*CALLS, "server"):
        py, hi, lean = (results[client][name] for client in CLIENTS[:3])
        row = f"| {name} | {spread(py)} | {spread(hi)} | {spread(lean)} | {statistics.median(lean) / statistics.median(hi):.2f} |"
        if args.before:
            old = results["lean-before"][name]
            row += f" {spread(old)} | {statistics.median(lean) / statistics.median(old):.2f} |"
        print(row)
    print("\nserver: the Redis server's CPU per call over a client's run (µs), every kind of call together")


if __name__ == "__main__":
    main()

"""What a request leaves in Redis: bytes appended to its append-only file, and memory held, by kind.

    .venv/bin/python -m bench.redis_footprint                          # this tree: 3,000 requests at 300/s
    .venv/bin/python -m bench.redis_footprint --before 7d615ed         # and a commit, one after the other

Each system runs `sluice run` with bench/throughput.py's config (the transport topology, exact cache on,
instant backend) on a Kafka and a Redis of its own, answers --warmup requests, then --requests at
--rate. Reported per measured request: the bytes Redis appended to its AOF (the incr file's growth,
parsed into commands by name and key kind; Redis rewrites the file on its own only past 64 MB, checked),
and the memory of every key (`MEMORY USAGE`) by kind, divided by every request answered so far. The AOF's
growth is what drives its automatic rewrites (a forked child writing the whole dataset), and the memory
what each rewrite writes: rate-limit logs hold only the last window, the rest lives its TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import redis.asyncio as aioredis

from bench import throughput
from bench.http_load import Pool, paced_posts
from bench.services import ROOT, own_services
from bench.throughput import PATH, SLUICE_PORT, Started, before_config, before_tree, body, sluice_config, wait_ready

KAFKA_PORT, REDIS_PORT, PORT = 19992, 17279, 19990


def commands(aof: bytes) -> list[list[bytes]]:
    """The commands of an AOF incr file (RESP arrays of bulk strings, as Redis writes them)."""
    out, i = [], 0
    while i < len(aof):
        end = aof.index(b"\r\n", i)
        argc, i = int(aof[i + 1:end]), end + 2
        args = []
        for _ in range(argc):
            end = aof.index(b"\r\n", i)
            length, i = int(aof[i + 1:end]), end + 2
            args.append(aof[i:i + length])
            i += length + 2
        out.append(args)
    return out


def kind(key: bytes) -> str:
    """`sluice:state:{id#emit}` -> `state#emit`, `sluice:rl:{...}:req` -> `rl`."""
    text = key.decode(errors="replace")
    parts = text.split(":")
    name = parts[1] if len(parts) > 2 and parts[0] == "sluice" else text[:12]
    return name + ("#" + text.split("#", 1)[1].rstrip("}") if "#" in text else "")


def size(args: list[bytes]) -> int:
    """Bytes the command takes in the AOF."""
    return len(b"*%d\r\n" % len(args)) + sum(len(b"$%d\r\n" % len(a)) + len(a) + 2 for a in args)


def incr_file(state: Path) -> Path:
    files = sorted((state / "appendonlydir").glob("*.incr.aof"))
    if len(files) != 1:
        raise RuntimeError(f"expected one AOF incr file, found {len(files)}: Redis rewrote its AOF during the run")
    return files[0]


async def measure(system: str, tree: Path, config: str, args: argparse.Namespace) -> tuple[Counter[str], Counter[str], Counter[str], int]:
    """(AOF bytes by command, AOF commands by command, memory by key kind, requests answered in all)."""
    state_name = f"bench-redis-footprint-{system}"
    with own_services(state_name, KAFKA_PORT, REDIS_PORT) as env:
        config = config.replace(f"127.0.0.1:{throughput.KAFKA_PORT}", env["SLUICE_KAFKA_BOOTSTRAP"]).replace(
            f"redis://127.0.0.1:{throughput.REDIS_PORT}/0", env["SLUICE_REDIS_URL"]).replace(f"port = {SLUICE_PORT}", f"port = {PORT}")
        path = Path(tempfile.mkdtemp(prefix="bench-redis-footprint-")) / "sluice.toml"
        path.write_text(config)
        server = Started(f"redis-footprint-{system}", [sys.executable, "-m", "pipeline.cli", "run"],
                         {**env, "SLUICE_CONFIG": str(path)}, PORT, tree)
        redis = aioredis.Redis.from_url(env["SLUICE_REDIS_URL"])
        try:
            await wait_ready(PORT, PATH, body(0, args.max_tokens))
            pool = Pool("127.0.0.1", PORT)
            warm = await paced_posts(pool, PATH, [body(i, args.max_tokens) for i in range(args.warmup)], args.rate)
            await asyncio.sleep(1.0)  # the last writes (emit's, after the answer) are in the file
            aof = incr_file(ROOT / ".state" / state_name)
            start = aof.stat().st_size
            sent = await paced_posts(pool, PATH, [body(i, args.max_tokens) for i in range(args.requests)], args.rate)
            await asyncio.sleep(1.0)
            pool.close()
            answered = sum(o.status == 200 for o in sent)
            if answered != args.requests:
                raise RuntimeError(f"{system}: {answered} of {args.requests} requests answered")
            grown = incr_file(ROOT / ".state" / state_name).read_bytes()[start:]
            by_bytes, by_count = Counter[str](), Counter[str]()
            for command in commands(grown):
                name = command[0].decode().upper() + (" " + kind(command[1]) if len(command) > 1 else "")
                by_bytes[name] += size(command)
                by_count[name] += 1
            memory = Counter[str]()
            async for key in redis.scan_iter(count=1000):
                memory[kind(key)] += await redis.memory_usage(key, samples=0) or 0
            return by_bytes, by_count, memory, answered + sum(o.status == 200 for o in warm) + 1
        finally:
            await redis.aclose()
            server.stop()


def report(system: str, measured: tuple[Counter[str], Counter[str], Counter[str], int], requests: int) -> None:
    by_bytes, by_count, memory, answered = measured
    print(f"\n{system}: AOF appended {sum(by_bytes.values()) / requests:,.0f} B per request "
          f"({sum(by_count.values()) / requests:.1f} commands); memory {sum(memory.values()) / answered:,.0f} B per request")
    print("\n| AOF command and key kind | commands per request | bytes per request |\n| --- | --- | --- |")
    for name, total in by_bytes.most_common():
        print(f"| {name} | {by_count[name] / requests:.2f} | {total / requests:,.0f} |")
    print("\n| key kind | memory per request, B |\n| --- | --- |")
    for name, total in memory.most_common():
        print(f"| {name} | {total / answered:,.0f} |")


async def run(args: argparse.Namespace) -> None:
    config = sluice_config("instant", False, args.processes, 0)
    systems = [("this tree", ROOT)] + ([(f"before {args.before}", before_tree(args.before))] if args.before else [])
    for name, tree in systems:
        measured = await measure(name.replace(" ", "-"), tree, config if tree == ROOT else before_config(config, tree), args)
        report(name, measured, args.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--before", help="a commit to measure the same way after this tree")
    args = parser.parse_args()
    os.chdir(ROOT)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

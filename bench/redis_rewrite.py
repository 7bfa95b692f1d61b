"""How long Redis takes to rewrite its append-only file over a real dataset, per value of one setting.

    .venv/bin/python -m bench.redis_rewrite --data .state/bench-throughput-0/appendonlydir
    .venv/bin/python -m bench.redis_rewrite --data DIR --setting rdbcompression --values yes,no --repeats 4

--data: an `appendonlydir` a benchmark left (bench.throughput keeps each system's Redis under
.state/bench-throughput-N). A copy of it is loaded by a Redis on infra/redis/redis.conf (automatic
rewrites off), then BGREWRITEAOF runs --repeats times per value, the values alternating, on an idle
machine. Reported: seconds from the command to the end of the rewrite (polled every 20 ms) and the size
of the base file written. Under load the same rewrite takes longer: it competes with everything else.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from bench.services import ROOT

PORT = 17999


def rewrite(client: redis.Redis) -> float:
    started = time.perf_counter()
    client.bgrewriteaof()
    time.sleep(0.02)
    while client.info("persistence")["aof_rewrite_in_progress"]:
        time.sleep(0.02)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--setting", default="rdbcompression")
    parser.add_argument("--values", default="yes,no")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-redis-rewrite-"))
    shutil.copytree(args.data, work / "appendonlydir")
    subprocess.run(["redis-server", str(ROOT / "infra" / "redis" / "redis.conf"), "--port", str(PORT), "--dir", str(work),
                    "--daemonize", "yes", "--logfile", str(work / "redis.log"), "--auto-aof-rewrite-percentage", "0"], check=True)
    client = redis.Redis(port=PORT)
    try:
        while client.info("persistence")["loading"]:
            time.sleep(0.1)
        memory = client.info("memory")["used_memory"]
        print(f"dataset: {client.dbsize():,} keys, {memory / 2**20:.0f} MiB")
        seconds: dict[str, list[float]] = {value: [] for value in args.values.split(",")}
        for _ in range(args.repeats):
            for value in seconds:
                client.config_set(args.setting, value)
                seconds[value].append(rewrite(client))
                base = max((work / "appendonlydir").glob("*.base.rdb"), key=lambda p: p.stat().st_mtime)
                print(f"{args.setting} {value}: {seconds[value][-1]:.3f} s, base file {base.stat().st_size / 2**20:.1f} MiB")
        for value, runs in seconds.items():
            print(f"{args.setting} {value}: median {statistics.median(runs):.3f} s ({min(runs):.3f}-{max(runs):.3f})")
    finally:
        client.shutdown(nosave=True)
        shutil.rmtree(work)


if __name__ == "__main__":
    main()

"""How long a whole guarded worker takes to start: from spawn to its "running stages" log line, with the
chaos suite's guarded config (every stage in one process, guards on, the exact cache). A killed worker's
streams wait about this long for a successor in `processes-guarded`, so it is part of every kill stall.

    .venv/bin/python -m bench.guard_start [--before REV] [--repeats 3]

With --before, the commit REV (a git worktree under .cache/bench, sharing this checkout's models) starts
too, alternating with this checkout, on the same Kafka and Redis and the same config (written from this
checkout's sluice.toml). Each tree starts once untimed first (files read from disk the first time, not
from the page cache). Prints each start, then the range per tree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.services import own_services
from bench.throughput import before_tree
from tests.chaos import harness
from tests.chaos.scenarios import GUARDED_CACHED

ROOT = Path(__file__).resolve().parent.parent
KAFKA_PORT, REDIS_PORT = 34092, 34379
READY = "running stages"


class _Services:
    def __init__(self, env: dict[str, str]) -> None:
        self.bootstrap, self.redis_url = env["SLUICE_KAFKA_BOOTSTRAP"], env["SLUICE_REDIS_URL"]


def start_seconds(tree: Path, env: dict[str, str], timeout_s: float = 120.0) -> float:
    """Seconds from spawning `sluice worker` in `tree` to its READY line; the worker is stopped after."""
    started = time.perf_counter()
    worker = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker"], env={**env, "PYTHONPATH": str(tree)},
                              cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stderr is not None
        for line in worker.stderr:
            if READY in line:
                return time.perf_counter() - started
            if time.perf_counter() - started > timeout_s:
                break
        raise RuntimeError(f"the worker in {tree} did not log {READY!r} (exit code {worker.poll()})")
    finally:
        worker.send_signal(2)
        worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a commit to start alternately with this checkout")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trees = {"now": ROOT}
    if args.before:
        tree = before_tree(args.before)
        models = tree / ".cache" / "models"
        if not models.exists():
            models.parent.mkdir(parents=True, exist_ok=True)
            models.symlink_to(ROOT / ".cache" / "models")
        trees = {f"before ({args.before})": tree, **trees}
    with own_services("guard-start", KAFKA_PORT, REDIS_PORT) as services:
        config = harness.write_config(Path(tempfile.mkdtemp()) / "sluice.toml", _Services(services), 40.0,
                                      GUARDED_CACHED, split=False)
        env = {**os.environ, **services, "SLUICE_CONFIG": str(config)}
        subprocess.run([sys.executable, "-m", "pipeline.cli", "topics", "create"], env=env, cwd=ROOT, check=True,
                       capture_output=True)
        for tree in trees.values():
            start_seconds(tree, env)
        seconds: dict[str, list[float]] = {name: [] for name in trees}
        for repeat in range(args.repeats):
            for name, tree in trees.items():
                seconds[name].append(start_seconds(tree, env))
                print(f"repeat {repeat} {name}: {seconds[name][-1]:.2f} s", flush=True)
    for name, values in seconds.items():
        print(f"{name}: {min(values):.2f}-{max(values):.2f} s over {len(values)} starts")


if __name__ == "__main__":
    main()

"""CPU per answer of `pipeline.stages.coalesce.coalesced()` alone: the working tree's against a commit's,
on answers whose deltas are at hand (the instant backend's case: 16 deltas, non-streaming and streaming).

    .venv/bin/python -m bench.coalesce --before e9ca72c      # 3 repeats, the two versions interleaved

The commit's coalesce.py is loaded with `git show`, beside the working tree's, in one process on uvloop;
reported as µs of CPU per answer, median (min..max) of the repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import uvloop

from pipeline.backends.base import Delta

HERE = Path(__file__).resolve().parent.parent


def load(name: str, source: str) -> ModuleType:
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def deltas(n: int) -> AsyncIterator[Delta]:
    for i in range(n):
        yield Delta(f"t{i} ", (i,), "length" if i == n - 1 else None)


async def per_answer(module: ModuleType, streaming: bool, answers: int, tokens: int) -> float:
    started = time.process_time()
    for _ in range(answers):
        async for _chunk in module.coalesced(deltas(tokens), streaming=streaming, first_alone=True):
            pass
    return (time.process_time() - started) / answers * 1e6


async def main(args: argparse.Namespace) -> None:
    before = subprocess.run(["git", "show", f"{args.before}:pipeline/stages/coalesce.py"], cwd=HERE,
                            capture_output=True, text=True, check=True).stdout
    versions = {args.before: load("coalesce_before", before),
                "now": load("coalesce_now", (HERE / "pipeline/stages/coalesce.py").read_text())}
    results: dict[tuple[str, bool], list[float]] = {}
    for repeat in range(args.repeats):
        order = list(versions) if repeat % 2 == 0 else list(reversed(versions))
        for streaming in (False, True):
            for name in order:
                results.setdefault((name, streaming), []).append(
                    await per_answer(versions[name], streaming, args.answers, args.tokens))
    print(f"µs of CPU per {args.tokens}-delta answer, median (min..max) of {args.repeats}:")
    for (name, streaming), values in results.items():
        kind = "streaming" if streaming else "non-streaming"
        print(f"  {name:>10} {kind:>13}: {statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--answers", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=16)
    sys.exit(uvloop.run(main(parser.parse_args())))

"""The input guard stage's own time for a prompt it has seen before (a chat's earlier turns, an exact cache
hit), with its verdict memo on and off, interleaved: `.venv/bin/python -m bench.guard_memo`."""
import asyncio
import statistics
import time

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard
from pipeline.settings import Settings
from pipeline.stages.guard import GuardStage
from tests.unit.guard.test_guard_stage import admitted
from tests.unit.helpers import node


async def main():
    guard = InputGuard(GuardSettings(), Settings().model_cache)
    stages = {m: GuardStage(Settings(guard=GuardSettings(verdict_memo=m)), guard, node("guard").topics) for m in (0, 20000)}
    texts = [f"Question {i}: what is the tallest mountain in region {i} and how was it first climbed?" for i in range(40)]
    sysmsg = "You are a helpful geography tutor. Answer briefly and cite a source when you can."
    times = {0: [], 20000: []}
    for rep in range(3):
        for t in texts:
            for m in ((0, 20000) if rep % 2 == 0 else (20000, 0)):
                env = admitted(t, system=sysmsg)
                start = time.perf_counter()
                async for _ in stages[m].handle(env):
                    pass
                if rep > 0:  # the first pass fills the memo
                    times[m].append((time.perf_counter() - start) * 1000)
    for m, ts in times.items():
        ts.sort()
        print(f"verdict_memo={m}: p50 {statistics.median(ts):.2f} ms, p90 {ts[int(len(ts)*0.9)]:.2f} ms, n={len(ts)}")

if __name__ == "__main__":
    asyncio.run(main())

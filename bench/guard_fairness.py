"""Head-of-line blocking in the guard stage: what one tenant's large prompts cost another's small ones.

    .venv/bin/python -m bench.guard_fairness [--small 60] [--large 4]

Runs `GuardStage.handle` (no broker: the stage's own costs) with the real Presidio and MiniLM guards:

1. alone: small 300-character prompts from tenant "interactive", one at a time (the input guard's
   latency per request, the figure the 20 ms target names);
2. under load: the same small prompts, one every 100 ms, while tenant "bulk" has `--large` PII-heavy
   32 KB prompts in the guard at once (they are allowed past the context check here, as if the
   model's context were unlimited, to load the guard as the issue's 32 KB prompts did);
3. the context check: how long a 32 KB prompt over SmolLM2's 8,192-token context takes to be refused.

Prints the small prompts' guard latency alone and under load (p50, p99, max), the added delay, how
long the large prompts took, and the refusal time. Latency is from `handle` being called to its
verdict, which is what the stage reports per request in `timings["guard"]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from bench.stats import percentile, row
from pipeline.errors import StageError
from pipeline.guard.context_limit import ContextLimit
from pipeline.guard.loader import InputGuard
from pipeline.settings import Settings
from pipeline.stages.guard import GuardStage
from pipeline.topology import graph
from topics.hops import Admitted, request_key
from topics.requests import ChatMessage, Request

SENTENCES = [
    "Can you explain how the event loop works in Node.js and why it matters for servers?",
    "I am planning a trip to Lisbon in May and would like a three day itinerary.",
    "What is the difference between a list and a tuple in Python, with examples?",
    "Please summarise the main causes of the French Revolution in plain words.",
    "Compare PostgreSQL and MySQL for a small web shop with a few thousand orders.",
]
PII = [
    "You can reach me at maria.lopez@example.com or on +1 415-555-0134.",
    "My card 4111 1111 1111 1111 was charged twice, the IBAN is DE89 3704 0044 0532 0130 00.",
    "I am John Carter and my server at 10.20.30.40 rejects my key sk-proj-Zx81kQw2LmN0pRt5VbY7cD3e.",
]


def text(chars: int, pool: list[str], rng: random.Random) -> str:
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < chars:
        parts.append(rng.choice(pool))
    return " ".join(parts)[:chars]


def admitted(i: int, content: str, tenant: str) -> Admitted:
    request = Request(id=f"{tenant[0]}{i}", reply_to="llm.responses.sdk", model=Settings().models[0], created_at=time.time(),
                      messages=(ChatMessage("user", content),), tenant=tenant)
    return Admitted(id=request_key(tenant, request.id), request=request, tenant=tenant, principal=tenant, admitted_at=time.time())


async def timed(stage: GuardStage, message: Admitted) -> float:
    started = time.perf_counter()
    try:
        [out async for out in stage.handle(message)]
    except StageError:
        pass
    return (time.perf_counter() - started) * 1000


async def small_prompts(stage: GuardStage, prompts: list[str], gap_s: float) -> list[float]:
    out = []
    for i, p in enumerate(prompts):
        out.append(await timed(stage, admitted(i, p, "interactive")))
        await asyncio.sleep(gap_s)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=60)
    parser.add_argument("--large", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(7)
    settings = Settings()
    topics = {n.kind: n for n in graph(settings.stages, settings.pools)}["guard"].topics
    guard = InputGuard(settings.guard, settings.model_cache)
    unlimited = GuardStage(settings, guard, topics, context=ContextLimit({}))
    checked = GuardStage(settings, guard, topics)
    # Distinct prompts for the warm-up, the alone pass and the loaded pass: the guard's verdict memo
    # answers a prompt it has screened before without screening it, which would hide the waiting.
    warm_up, small, small_loaded = ([text(300, SENTENCES + PII[:1], rng) for _ in range(n)] for n in (10, args.small, args.small))
    large = [text(32_000, PII + SENTENCES, rng) for _ in range(args.large)]
    await small_prompts(unlimited, warm_up, 0)

    alone = await small_prompts(unlimited, small, 0.1)
    started = time.perf_counter()
    bulk = [asyncio.create_task(timed(unlimited, admitted(i, t, "bulk"))) for i, t in enumerate(large)]
    await asyncio.sleep(0.5)
    loaded = await small_prompts(unlimited, small_loaded, 0.1)
    bulk_ms = await asyncio.gather(*bulk)
    print(f"{args.large} large prompts of 32,000 characters from tenant bulk took {min(bulk_ms) / 1000:.1f}-{max(bulk_ms) / 1000:.1f} s "
          f"in the guard (all done {time.perf_counter() - started:.1f} s after the first arrived)")
    refusal = [await timed(checked, admitted(i, t, "bulk")) for i, t in enumerate(large)]
    print(f"context check: 32 KB prompts over the model's context refused in {max(refusal):.1f} ms at most "
          f"(of {checked._context.content_tokens(admitted(0, large[0], 'bulk').request)} content tokens for the first)")
    print("| tenant interactive, 300-character prompts | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    print(row("alone", alone))
    print(row(f"while tenant bulk has {args.large} x 32 KB in the guard", loaded))
    def added(q: float) -> float:
        return percentile(loaded, q) - percentile(alone, q)

    print(f"delay added by the bulk tenant: p50 {added(50):+.1f} ms, p99 {added(99):+.1f} ms, "
          f"max {max(loaded) - max(alone):+.1f} ms (max under load {max(loaded):.0f} ms, max alone {max(alone):.0f} ms); "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())

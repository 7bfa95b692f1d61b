"""Guardrail latency: the input guard (PII and injection together) per 300-character prompt, and what
postguard adds per streamed chunk.

    .venv/bin/python -m bench.guard_latency [--requests 300] [--chunks 3000] [--toxicity-backend minilm] [--answer code]

Input guard: one request at a time (batch 1, the latency case) through `GuardStage.handle`, which
runs Presidio (spaCy NER + the recognisers) and the MiniLM int8 classifier in a worker thread; also
each part alone. Prompts are 300 characters built from ordinary sentences, a third with PII in them.
The 20 warm-up prompts are drawn apart and none is timed: the verdict memo (on by default) would answer it.
Postguard: `PostguardStage.handle` per chunk of answers streamed word by word (holdback 16, default
[guard] settings: pattern PII, blocklist, toxicity by `--toxicity-backend`, the [guard] default unless
named), the time from the chunk's arrival to the handler's last output. `--requests 0` measures
postguard alone. `--answer code` streams a code block instead of prose (no sentence ends, but line
breaks), `--answer run-on` one line with no punctuation at all (what the chaos suite's instant backend
writes), so the sentence that postguard must check before it releases text never ends. No broker: these are the
stages' own costs, the figures the targets name.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time

from bench.stats import row
from pipeline.errors import StageError
from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard, TextCheck, output_guard
from pipeline.settings import Settings
from pipeline.stages.guard import GuardStage
from pipeline.stages.postguard import PostguardStage
from pipeline.topology import Topics, graph
from topics.hops import Admitted, request_key
from topics.requests import ChatMessage, Request
from topics.stream import Chunk, Done, FinishReason, Usage

SENTENCES = [
    "Can you explain how the event loop works in Node.js and why it matters for servers?",
    "I am planning a trip to Lisbon in May and would like a three day itinerary.",
    "What is the difference between a list and a tuple in Python, with examples?",
    "Please summarise the main causes of the French Revolution in plain words.",
    "My team keeps missing deadlines; how should I run our weekly planning meeting?",
    "Write a short poem about the sea at night, with a calm and hopeful tone.",
    "How much water should a healthy adult drink each day, and does coffee count?",
    "Compare PostgreSQL and MySQL for a small web shop with a few thousand orders.",
]
PII = [
    "You can reach me at maria.lopez@example.com or on +1 415-555-0134.",
    "My card 4111 1111 1111 1111 was charged twice, the IBAN is DE89 3704 0044 0532 0130 00.",
    "I am John Carter and my server at 10.20.30.40 rejects my key sk-proj-Zx81kQw2LmN0pRt5VbY7cD3e.",
]
ANSWER = (
    "Sure. The event loop is the part of Node.js that waits for work and runs callbacks one at a time. "
    "When a request arrives, the loop hands slow work such as disk or network access to the system, and "
    "keeps serving other requests meanwhile. When that work finishes, its callback is queued and runs "
    "on the loop. This is why one Node.js process can serve many clients at once, as long as no single "
    "callback blocks the loop for long. Heavy computation belongs in a worker thread. "
)

CODE_ANSWER = (
    "def retry(call, attempts=3, delay_s=0.5):\n    for attempt in range(attempts):\n        try:\n"
    "            return call()\n        except ConnectionError:\n            if attempt == attempts - 1:\n"
    "                raise\n            time.sleep(delay_s * 2 ** attempt)\n\n\nresult = retry(lambda: "
    "client.get(url, timeout=5))\nprint(result.status_code, len(result.content))\n"
)
RUN_ON = " ".join(f"t{i}" for i in range(120))  # the chaos suite's instant backend: one line, no punctuation
ANSWERS = {"prose": ANSWER, "code": CODE_ANSWER, "run-on": RUN_ON}
WARMUP = 20  # prompts through the guard stage before timing, none of them timed


def prompts(n: int, rng: random.Random) -> list[str]:
    out = []
    for i in range(n):
        parts = [rng.choice(PII)] if i % 3 == 0 else []
        while sum(len(p) + 1 for p in parts) < 300:
            parts.append(rng.choice(SENTENCES))
        rng.shuffle(parts)
        out.append(" ".join(parts)[:300])
    return out


def topics_of(settings: Settings, kind: str) -> Topics:
    return {n.kind: n for n in graph(settings.stages, settings.pools)}[kind].topics


def admitted(i: int, text: str, model: str) -> Admitted:
    request = Request(id=f"b{i}", reply_to="llm.responses.sdk", model=model, created_at=time.time(), messages=(ChatMessage("user", text),))
    return Admitted(id=request_key("default", request.id), request=request, tenant="default", principal="default", admitted_at=time.time())


async def input_guard(n: int, rng: random.Random) -> list[str]:
    settings = Settings()
    guard = InputGuard(settings.guard, settings.model_cache)
    stage = GuardStage(settings, guard, topics_of(settings, "guard"))
    warm, texts = prompts(WARMUP, random.Random(2)), prompts(n, rng)  # warm-up texts from their own seed
    texts = [t for t in texts if t not in warm]  # the memo would answer a text the warm-up saw in about 0.4 ms
    for i, t in enumerate(warm):  # warm-up: first calls allocate and compile
        await run(stage, admitted(n + i, t, settings.models[0]))
    handler, pii, injection, refused = [], [], [], 0
    for i, t in enumerate(texts):
        started = time.perf_counter()
        refused += not await run(stage, admitted(i, t, settings.models[0]))
        handler.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        guard.pii.analyze([t])
        pii.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        guard.injection.score([t])
        injection.append((time.perf_counter() - started) * 1000)
    _ = guard.check([[TextCheck(t, True)] for t in texts[:16]])
    print(f"input guard refused {refused} of {len(texts)} benign prompts")
    return [row("input guard: guard stage handler (PII + injection)", handler), row("  PII alone (Presidio + spaCy NER)", pii),
            row("  injection alone (MiniLM int8 head + lexical model + patterns)", injection)]


async def run(stage: GuardStage, message: Admitted) -> bool:
    """Whether the stage passed the request (a refusal is a StageError, counted, not a crash)."""
    try:
        [out async for out in stage.handle(message)]
    except StageError:
        return False
    return True


async def _handled(stage: PostguardStage, message: Chunk | Done) -> None:
    """`stage.handle(message)`, each output taken as the broker would take it (`delivered`, then `acked`, as
    the runner calls them): a `Done` waits for its released chunks' acknowledgements, which without this
    never came (the benchmark stopped with InfraUnavailable)."""
    async for out in stage.handle(message):
        if out.delivered is not None:
            out.delivered()
        if out.acked is not None:
            await out.acked()


async def postguard(chunks: int, toxicity_backend: str, answer: str = "prose") -> list[str]:
    settings = GuardSettings(toxicity_backend=toxicity_backend)  # type: ignore[arg-type]
    stage = PostguardStage(settings, output_guard(settings, Settings().model_cache), topics_of(Settings(), "postguard"))
    words = re.findall(r"\S+\s*", ANSWERS[answer])  # each word with the spaces or line breaks after it
    per_chunk, rid, sent = [], 0, 0
    while sent < chunks:
        rid += 1
        for seq, word in enumerate(words):
            started = time.perf_counter()
            await _handled(stage, Chunk(id=f"p{rid}", reply_to="llm.responses.sdk", seq=seq, text=word, tenant="default"))
            per_chunk.append((time.perf_counter() - started) * 1000)
        done = Done(id=f"p{rid}", reply_to="llm.responses.sdk", chunks=len(words), digest="", finish_reason=FinishReason.stop,
                    usage=Usage(), tenant="default", model="m", created_at=time.time())
        await _handled(stage, done)
        sent += len(words)
    what = f"postguard per chunk ({answer}, holdback {settings.holdback_tokens}, toxicity {toxicity_backend})"
    return [row(what, per_chunk[len(words):])]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=3000)
    parser.add_argument("--toxicity-backend", default=GuardSettings().toxicity_backend, choices=("profanity_check", "minilm"))
    parser.add_argument("--answer", default="prose", choices=sorted(ANSWERS), help="what postguard streams")
    args = parser.parse_args()
    rows = await input_guard(args.requests, random.Random(7)) if args.requests else []
    rows += await postguard(args.chunks, args.toxicity_backend, args.answer)
    print("| what | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    asyncio.run(main())

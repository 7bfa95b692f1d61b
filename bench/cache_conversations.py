"""What the semantic tier does with multi-turn chats: fow-cache's 240 labelled conversation pairs, scored by
the cache's own rule (the earlier turns must match exactly, `keys.context`; then the last user turn's
similarity at the default threshold and the trap check, as in bench/cache_pairs.py).

    .venv/bin/python -m bench.cache_conversations

Each pair is two chats whose last user turns ask the same (or nearly the same) thing. Should-hit subtypes
(one answer fits both): `same_context_reworded`, `irrelevant_history`, `same_context_extra_chatter`. Traps (the
history changes the answer): `context_swap`, `detail_swap`, `intent_flip`. Labels written by a language model.
Nothing is tuned here: the threshold is the default that bench/cache_pairs.py picked.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from fow_cache.data import load_conversations  # the package's own reader of its conv-parts and conv-long files

from pipeline.cache import keys, spelling
from pipeline.cache.config import DEFAULT_THRESHOLD
from pipeline.cache.traps import conflicts, salient
from pipeline.guard.embedder import load_embedder
from pipeline.settings import Settings
from topics.requests import ChatMessage, Request

SHOULD_HIT = ("same_context_reworded", "irrelevant_history", "same_context_extra_chatter")
TRAPS = ("context_swap", "detail_swap", "intent_flip")


def load() -> list[dict[str, object]]:
    out = load_conversations()
    unknown = {str(c["subtype"]) for c in out} - set(SHOULD_HIT + TRAPS)
    if unknown:
        raise ValueError(f"conversations of subtypes this bench does not know: {sorted(unknown)}")
    return out


def as_request(turns: list[dict[str, str]]) -> Request:
    messages = tuple(ChatMessage(role=t["role"], content=t["content"]) for t in turns)
    return Request(id="conversation", reply_to="llm.replies", model="default", created_at=0.0, messages=messages)


def main() -> None:
    pairs = load()
    embedder = load_embedder(Settings().model_cache)
    reasons: dict[str, Counter[str]] = {s: Counter() for s in SHOULD_HIT + TRAPS}
    for pair in pairs:
        a, b = as_request(pair["a"]), as_request(pair["b"])  # type: ignore[arg-type]
        if keys.context("t", a) != keys.context("t", b):
            reasons[str(pair["subtype"])]["earlier turns differ"] += 1
            continue
        qa, qb = (spelling.corrected(keys.last_turn(r) or "") for r in (a, b))
        va, vb = embedder.embed([qa, qb])
        if float(np.dot(va, vb)) < DEFAULT_THRESHOLD:
            reasons[str(pair["subtype"])]["below the threshold"] += 1
        elif conflicts(salient(qa), salient(qb)):
            reasons[str(pair["subtype"])]["trap check"] += 1
        else:
            reasons[str(pair["subtype"])]["served"] += 1
    print(f"{len(pairs)} conversation pairs, default threshold {DEFAULT_THRESHOLD:.2f}\n")
    print("| subtype | kind | n | served | not served: earlier turns differ / below the threshold / trap check |")
    print("| --- | --- | ---: | ---: | --- |")
    for subtype, counts in reasons.items():
        kind = "should hit" if subtype in SHOULD_HIT else "trap"
        n = sum(counts.values())
        print(f"| {subtype} | {kind} | {n} | {counts['served']} | {counts['earlier turns differ']} / "
              f"{counts['below the threshold']} / {counts['trap check']} |")


if __name__ == "__main__":
    main()

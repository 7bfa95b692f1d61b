"""Off-topic detection: how well a route's topics (sluice.toml `[guard.routes."<model>"]`) tell answers
and prompts that stay on them from those that leave them.

    .venv/bin/python -m bench.off_topic_accuracy

`bench/data/off_topic_labelled.jsonl` was written for this check: two example routes (an airline's
customer support and Python programming help), each with four topics, 25 on-topic and 20 off-topic
answers and 10 + 10 prompts. Off-topic texts include the other route's subject, general knowledge, a
drift into small talk and, for the airline, a recommendation of a competitor (on the airline's words,
off its policy: what an embedding cannot see).

Prints, for each way of comparing a text with the topics (each description whole, or its pieces:
on_topic.topic_pieces), the ROC AUC per route and kind, then, at the default thresholds
(`RouteTopics()`), the share of on-topic texts refused (false refusals) and of off-topic texts caught,
a cross-route check (the highest threshold that refuses no on-topic answer of one route, applied to
the other route, so a threshold is also judged on a route it was not read from), and streaming
through postguard's own checks (on_topic.TopicWatch, word by word): 25 long on-topic answers per route
(three of its answers and a generic closing sentence) that must pass, and 20 drifts (an on-topic
answer, then two off-topic ones) that should end, with how far past the drift's start they end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import load_embedder
from pipeline.guard.on_topic import MIN_CHARS, Embedder, RouteTopics, TopicScope, TopicWatch, topic_pieces
from pipeline.settings import Settings

DATA = Path(__file__).resolve().parent / "data" / "off_topic_labelled.jsonl"
CLOSINGS = ("Is there anything else I can help you with today?", "I hope this helps, and have a great day!",
            "Let me know if you have any other questions.")


def auc(on: list[float], off: list[float]) -> float:
    """P(an on-topic text scores above an off-topic one), ties counted half."""
    wins = sum((a > b) + 0.5 * (a == b) for a in on for b in off)
    return wins / (len(on) * len(off))


def main() -> None:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    embedder = load_embedder(Settings().model_cache)
    topics = {r["route"]: r["topics"] for r in rows if r["kind"] == "topics"}
    examples = [r for r in rows if r["kind"] in ("answer", "prompt")]
    vectors = embedder.embed([r["text"] for r in examples])
    defaults = RouteTopics(topics=())
    scores: dict[str, list[float]] = {}
    for method in ("whole", "pieces"):
        refs = {route: embedder.embed(ts if method == "whole" else [p for t in ts for p in topic_pieces(t)]) for route, ts in topics.items()}
        scores[method] = [float((refs[r["route"]] @ v).max()) for r, v in zip(examples, vectors, strict=True)]
    print(f"{len(examples)} texts, {len(topics)} routes")
    print("| compared with | route | kind | on / off | ROC AUC |\n| --- | --- | --- | --- | --- |")
    for method, values in scores.items():
        for route in topics:
            for kind in ("answer", "prompt"):
                on = [s for r, s in zip(examples, values, strict=True) if r["route"] == route and r["kind"] == kind and r["on_topic"]]
                off = [s for r, s in zip(examples, values, strict=True) if r["route"] == route and r["kind"] == kind and not r["on_topic"]]
                print(f"| {method} | {route} | {kind} | {len(on)} / {len(off)} | {auc(on, off):.3f} |")
    pieces = scores["pieces"]

    def rates(route: str, kind: str, threshold: float) -> tuple[float, float]:
        chosen = [(r, s) for r, s in zip(examples, pieces, strict=True) if r["route"] == route and r["kind"] == kind]
        judged = [(r, s) for r, s in chosen if kind == "prompt" or len(r["text"]) >= MIN_CHARS]
        refused = [r for r, s in judged if s < threshold]
        on = sum(r["on_topic"] for r, _ in chosen)
        return sum(r["on_topic"] for r in refused) / on, sum(not r["on_topic"] for r in refused) / (len(chosen) - on)

    print(f"\nat the defaults (answers {defaults.threshold}, prompts {defaults.prompt_threshold}), pieces:")
    print("| route | kind | on-topic refused | off-topic caught |\n| --- | --- | --- | --- |")
    for route in topics:
        for kind, threshold in (("answer", defaults.threshold), ("prompt", defaults.prompt_threshold)):
            false_refusals, caught = rates(route, kind, threshold)
            print(f"| {route} | {kind} | {false_refusals:.1%} | {caught:.1%} |")
    print("\ncross-route: the highest threshold refusing no on-topic answer of one route, on the other's answers:")
    print("| read from | threshold | applied to | on-topic refused | off-topic caught |\n| --- | --- | --- | --- | --- |")
    for source, target in zip(topics, list(topics)[::-1], strict=True):
        on = [s for r, s in zip(examples, pieces, strict=True) if r["route"] == source and r["kind"] == "answer" and r["on_topic"]]
        threshold = float(np.floor(min(on) * 100) / 100)
        false_refusals, caught = rates(target, "answer", threshold)
        print(f"| {source} | {threshold:.2f} | {target} | {false_refusals:.1%} | {caught:.1%} |")
    streaming(embedder, topics, rows)


def ends_at(scope: TopicScope, text: str) -> int | None:
    """Where postguard's topic watch ends `text` streamed word by word (characters in), or None."""
    watch, seen = TopicWatch(scope), 0
    for word in text.split():
        seen += len(word) + 1
        if watch.push(word + " "):
            return seen
    return seen if watch.finish() else None


def streaming(embedder: Embedder, topics: dict[str, list[str]], rows: list[dict[str, object]]) -> None:
    print("\nstreaming through postguard's topic watch, at the default threshold:")
    print("| route | long on-topic answers ended | drifts ended | characters past the drift's start (median) |")
    print("| --- | --- | --- | --- |")
    for route, route_topics in topics.items():
        scope = TopicScope(embedder, RouteTopics(tuple(route_topics)))
        answers = [r for r in rows if r["route"] == route and r["kind"] == "answer"]
        on = [str(r["text"]) for r in answers if r["on_topic"]]
        off = [str(r["text"]) for r in answers if not r["on_topic"]]
        longs = [" ".join([*on[i : i + 3], CLOSINGS[i % 3]]) for i in range(len(on))]
        ended_long = sum(ends_at(scope, t) is not None for t in longs)
        lags = []
        for i in range(len(off)):
            start = len(" ".join(on[i].split())) + 1
            end = ends_at(scope, f"{on[i]} {off[i]} {off[(i + 7) % len(off)]}")
            if end is not None:
                lags.append(end - start)
        print(f"| {route} | {ended_long} of {len(longs)} | {len(lags)} of {len(off)} | {float(np.median(lags)) if lags else float('nan'):.0f} |")


if __name__ == "__main__":
    main()

"""Off-topic text: a route (a model name, as clients ask for it) may name the topics it serves, a
sentence or a few each (`[guard.routes."<model>"] topics`). Guard compares the prompt's last user turn
with them, postguard the answer as it grows; below the route's threshold the text has left them, and
the request or the answer ends with a 400 `content_filter`, reason `off_topic`.

Similarity is the cosine between the text's MiniLM embedding (the model the injection classifier and
the semantic cache already load) and the nearest *piece* of a topic: each description whole, its head
before a colon, and each item of its list (split at commas and "and"). A long description averages
many meanings into one vector; its pieces let a text near any one of them count as on topic
(bench/off_topic_accuracy.py measured both: the pieces separate on- from off-topic answers better).

Answers are judged as they stream (`TopicWatch`): each finished sentence of at least
`SENTENCE_MIN_CHARS` is compared with the topics, and `RUN` of them in a row below the threshold end the
answer, so it is caught where it drifts while one generic sentence ("Is there anything else I can help
you with?") is not enough; at the end the latest `WINDOW_CHARS` of the answer are judged whole, which
catches a short answer that was off topic from its first word. One embedding (~8 ms) per sentence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.guard.visible import visible

MIN_CHARS = 60  # shorter answers ("Yes.", "Thanks!") say too little to judge: never refused as off topic
SENTENCE_MIN_CHARS = 20  # shorter sentences ("Sure.") are not judged on their own
RUN = 2  # this many judged sentences in a row below the threshold: the answer has left the topics
WINDOW_CHARS = 400  # at the end, the answer's latest text is judged whole
_LIST = re.compile(r",|;|\band\b|\bor\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


class Embedder(Protocol):
    def embed(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class RouteTopics:
    """`[guard.routes."<model>"]`: what one route serves."""

    topics: tuple[str, ...]  # a sentence or a few each, e.g. "Baggage: allowances, fees, lost or damaged luggage."
    threshold: float = 0.25  # an answer whose similarity to every topic is below this has left them
    prompt_threshold: float = 0.25  # the same for the prompt's last user turn (0: prompts are not checked)


def topic_pieces(topic: str) -> list[str]:
    """The description, its head (before a colon) and each item of its list, without duplicates."""
    head, colon, rest = topic.partition(":")
    items = [p.strip(" .") for p in _LIST.split(rest if colon else topic)]
    return list(dict.fromkeys(p for p in [topic.strip(), head.strip() if colon else "", *items] if len(p) > 2))


class TopicScope:
    """One route's topics, embedded once."""

    def __init__(self, embedder: Embedder, route: RouteTopics) -> None:
        self._embedder = embedder
        self.route = route
        self._vectors = embedder.embed([p for t in route.topics for p in topic_pieces(t)])

    def similarity(self, text: str) -> float:
        """The cosine between `text` and the nearest piece of the route's topics."""
        return float((self._vectors @ self._embedder.embed([text])[0]).max())

    def answer_off_topic(self, text: str) -> bool:
        return len(text.strip()) >= MIN_CHARS and self.similarity(text[-WINDOW_CHARS:]) < self.route.threshold

    def sentence_off_topic(self, sentence: str) -> bool | None:
        """None for a sentence too short to judge."""
        if len(sentence.strip()) < SENTENCE_MIN_CHARS:
            return None
        return self.similarity(sentence) < self.route.threshold

    def prompt_off_topic(self, text: str) -> bool:
        threshold = self.route.prompt_threshold
        return threshold > 0 and len(visible(text).split()) >= 3 and self.similarity(text[-WINDOW_CHARS:]) < threshold


class TopicScopes:
    """Every configured route's scope, by model name."""

    def __init__(self, routes: Mapping[str, RouteTopics], embedder: Embedder) -> None:
        self._scopes = {model: TopicScope(embedder, route) for model, route in routes.items() if route.topics}

    def for_model(self, model: str) -> TopicScope | None:
        return self._scopes.get(model)

    def __bool__(self) -> bool:
        return bool(self._scopes)


@dataclass
class TopicWatch:
    """One streaming answer's progress against its route's topics (postguard's StreamState holds it)."""

    scope: TopicScope
    answer: str = ""  # the latest WINDOW_CHARS characters
    sentence: str = ""  # the sentence being written
    run: int = 0  # judged sentences in a row below the threshold

    def push(self, text: str) -> bool:
        """Whether the answer has now left the topics."""
        self.answer = (self.answer + text)[-WINDOW_CHARS:]
        *finished, self.sentence = _SENTENCE_END.split(self.sentence + text)
        return any(self._judge(s) for s in finished)  # stops at the first that decides

    def finish(self) -> bool:
        """At the end of the answer: its last sentence, then its latest text whole."""
        return self._judge(self.sentence) or self.scope.answer_off_topic(self.answer)

    def _judge(self, sentence: str) -> bool:
        off = self.scope.sentence_off_topic(sentence)
        if off is not None:
            self.run = self.run + 1 if off else 0
        return self.run >= RUN

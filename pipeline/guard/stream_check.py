"""The holdback window postguard keeps for each streaming answer, and the checks run on it.

Each chunk is appended to `pending`. The checks read the current sentence's released part plus
`pending`: the regex blocklist, toxicity sentence by sentence, and the pattern PII recognisers; on a
route that names its topics, each finished sentence is compared with them (on_topic.TopicWatch: an
answer that has left them ends, releasing nothing more). When
nothing is flagged, everything but the newest `holdback` chunks is released, with PII redacted by
policy; a finding that crosses the release point is held back whole. When something is flagged,
only the text before the flagged span is released and the stream ends (`Step.violation`).

The PII recognisers read `pending` normalised (full-width forms folded, invisible characters removed:
normalise.py) and their findings come back as spans of `pending` as written, zero-width characters
inside them included; so holding back, releasing and redacting all act on the text as it arrived, and
an entity split by an invisible character, in one chunk or across two, is held back and replaced whole.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline.guard.entities import Action
from pipeline.guard.errors import Reason
from pipeline.guard.on_topic import TopicScope, TopicScopes, TopicWatch
from pipeline.guard.pii import Finding, PatternScanner
from pipeline.guard.redact import Placeholders, apply_policy
from pipeline.guard.toxicity import ToxicityScorer

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_CONTEXT_CHARS = 400  # at most this much of the current sentence's released text is kept for re-reading


@dataclass
class StreamState:
    policy: Mapping[str, Action]
    pending: str = ""
    lengths: deque[int] = field(default_factory=deque)  # characters of each held chunk, oldest first
    context: str = ""  # released text of the sentence still open
    placeholders: Placeholders = field(default_factory=Placeholders)
    toxicity: dict[str, float] = field(default_factory=dict)  # scores of the window's sentences, by text
    scored_to: int = 0  # `pending` up to here was scored as part of the sentence still open
    topics: TopicWatch | None = None  # the answer against its route's topics, if the route names any


@dataclass(frozen=True)
class Step:
    release: str  # text to send now ("" for nothing)
    violation: Reason | None = None


@dataclass(frozen=True)
class _Cut:
    at: int  # position in `pending` where the flagged span starts (0 when it began in released text)
    reason: Reason


class OutputGuard:
    def __init__(
        self, scanner: PatternScanner, toxicity: ToxicityScorer, *, holdback: int, blocklist: tuple[str, ...],
        toxicity_threshold: float, topics: TopicScopes | None = None,
    ) -> None:
        self._scanner = scanner
        self._topics = topics
        self._toxicity = toxicity
        self._holdback = holdback
        self._blocklist = tuple(re.compile(p, re.IGNORECASE) for p in blocklist)
        self._threshold = toxicity_threshold

    def watch(self, model: str) -> TopicWatch | None:
        """A fresh watch of an answer against the topics `model`'s route serves, if it names any."""
        scope: TopicScope | None = self._topics.for_model(model) if self._topics else None
        return TopicWatch(scope) if scope is not None else None

    def push(self, state: StreamState, text: str) -> Step:
        state.pending += text
        state.lengths.append(len(text))
        left = state.topics is not None and state.topics.push(text)
        return self._step(state, final=False, left_topics=left)

    def finish(self, state: StreamState) -> Step:
        return self._step(state, final=True, left_topics=state.topics is not None and state.topics.finish())

    def _step(self, state: StreamState, *, final: bool, left_topics: bool) -> Step:
        findings = self._scanner.scan(state.pending)
        release = len(state.pending) if final else sum(list(state.lengths)[: max(len(state.lengths) - self._holdback, 0)])
        cut = self._first_violation(state, findings, release)
        if cut is None and left_topics:
            cut = _Cut(0, Reason.off_topic)  # nothing more of it is released
        upto = cut.at if cut is not None else release
        crossed = True
        while crossed:  # never release part of a finding: hold it back whole, and any finding it overlaps
            crossed = False
            for f in findings:
                if f.start < upto < f.end:
                    upto, crossed = f.start, True
        released = self._release(state, upto, [f for f in findings if f.end <= upto])
        return Step(released, cut.reason if cut is not None else None)

    def _first_violation(self, state: StreamState, findings: list[Finding], release: int) -> _Cut | None:
        cuts: list[_Cut] = []
        offset = len(state.context)
        window = state.context + state.pending
        for pattern in self._blocklist:
            if match := pattern.search(window):
                cuts.append(_Cut(max(match.start() - offset, 0), Reason.blocklist))
        starts, sentences = self._sentences(window)
        if sentences and not _SENTENCE_END.search(window[starts[-1]:]):
            if starts[-1] - offset >= release or release <= state.scored_to:
                # The sentence still being written is scored once it ends, or once text of it that no
                # score has read is about to be released: until then it is held back anyway. A sentence
                # longer than the window (a line with no punctuation) is so scored once per `holdback`
                # chunks, not on every chunk (a score costs 2-10 ms).
                starts, sentences = starts[:-1], sentences[:-1]
            else:
                state.scored_to = len(state.pending)
        for start, score in zip(starts, self._toxicity_scores(state, sentences)):
            if score >= self._threshold:
                cuts.append(_Cut(max(start - offset, 0), Reason.toxicity))
                break
        blocked = [f.start for f in findings if state.policy.get(f.entity) == "block"]  # overlapped or not
        if blocked:
            cuts.append(_Cut(min(blocked), Reason.output_pii))
        return min(cuts, key=lambda c: c.at) if cuts else None

    def _toxicity_scores(self, state: StreamState, sentences: list[str]) -> list[float]:
        """Scores each sentence once: a finished sentence does not change while the window moves on,
        so per chunk only the sentence still being written is scored again."""
        new = [s for s in dict.fromkeys(sentences) if s not in state.toxicity]
        known = {s: state.toxicity[s] for s in sentences if s in state.toxicity}
        if new:
            known.update(zip(new, self._toxicity.scores(new)))
        state.toxicity = known
        return [known[s] for s in sentences]

    @staticmethod
    def _sentences(text: str) -> tuple[list[int], list[str]]:
        starts, sentences, at = [], [], 0
        for end in [m for m in _SENTENCE_END.finditer(text)] + [None]:
            stop = end.start() if end is not None else len(text)
            if text[at:stop].strip():
                starts.append(at)
                sentences.append(text[at:stop])
            at = end.end() if end is not None else stop
        return starts, sentences

    def _release(self, state: StreamState, upto: int, findings: list[Finding]) -> str:
        if upto <= 0:
            return ""
        raw = state.pending[:upto]
        text = apply_policy(raw, findings, state.policy, state.placeholders).text
        state.pending = state.pending[upto:]
        state.scored_to = max(state.scored_to - upto, 0)
        left = upto
        while state.lengths and left >= state.lengths[0]:
            left -= state.lengths.popleft()
        if state.lengths and left:
            state.lengths[0] -= left
        tail = _SENTENCE_END.split(state.context + raw)[-1]
        state.context = tail[-_CONTEXT_CHARS:]
        return text

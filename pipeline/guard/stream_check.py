"""The holdback window postguard keeps for each streaming answer, and the checks run on it.

Each chunk is appended to `pending`. The checks read the current sentence's released part plus
`pending`: the regex blocklist, toxicity sentence by sentence, and the pattern PII recognisers; on a
route that names its topics, each finished sentence is compared with them (on_topic.TopicWatch: an
answer that has left them ends, releasing nothing more). When
nothing is flagged, everything but the newest `holdback` chunks (and at least the newest
`CHARS_PER_TOKEN` x `holdback` characters) is released, with PII redacted by policy; a finding that
crosses the release point is held back whole. When something is flagged, only the text before the
flagged span is released and the stream ends (`Step.violation`).

A recogniser finds an entity only once it is whole (a card's Luhn sum, an IBAN's checksum, a key's
length), and a tokenizer writes digits one per token and random letters one or two: a card number or a
`ghp_` key is longer than 16 chunks, so without more its first characters left the window before it
could be recognised, and then the rest of it, no longer a whole entity, left in clear. So the release
point never falls inside an entity-shaped run (`_entity_runs`): one that reaches it is held from its
start, up to `ENTITY_RUN_CAP` characters (of a longer run, a URL or a base64 blob, the newest
`ENTITY_RUN_CAP` characters are held: no one entity is that long, and holding all of it would stall
the stream). The character floor covers what is not one run: an entity of at most `CHARS_PER_TOKEN` x
`holdback` characters (64 by default), "+1 (555) 123-4567" or `api_key = "..."` included, is whole in
the window before its first character leaves. Context words ("social security" before an SSN) are
read in the open sentence's released text too (`PatternScanner.scan`'s `context`).

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
from pipeline.guard.normalise import normalise
from pipeline.guard.on_topic import TopicScope, TopicScopes, TopicWatch
from pipeline.guard.pii import Finding, PatternScanner
from pipeline.guard.redact import Placeholders, apply_policy
from pipeline.guard.toxicity import ToxicityScorer

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_CONTEXT_CHARS = 400  # at most this much of the current sentence's released text is kept for re-reading
CHARS_PER_TOKEN = 4  # the window holds at least this many characters per `holdback` chunk (64 by default)
ENTITY_RUN_CAP = 256  # at most this much of an entity-shaped run reaching the release point is held
# An entity-shaped word: what e-mail addresses, keys, tokens, JWTs, IPs and dashed numbers are made of.
_RUN_WORD = re.compile(r"[A-Za-z0-9@._+/=:-]+")
_DIGITS = re.compile(r"[0-9]+")
_IBAN_HEAD = re.compile(r"[A-Za-z]{2}[0-9]{2}")  # an IBAN's country code and check digits: "GB82", "gb82"
_GROUP = 4  # the longest other word joined to a group of digits or an IBAN's head: IBANs are written in fours


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
        findings = self._scanner.scan(state.pending, state.context)
        release = len(state.pending) if final else self._release_point(state)
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

    def _release_point(self, state: StreamState) -> int:
        """Where the text that is not flagged may be released up to: before the newest `holdback` chunks
        and `CHARS_PER_TOKEN` x `holdback` characters, moved back to the start of an entity-shaped run
        that reaches it (or to `ENTITY_RUN_CAP` characters before it, for a longer run)."""
        chunks = sum(list(state.lengths)[: max(len(state.lengths) - self._holdback, 0)])
        release = max(min(chunks, len(state.pending) - CHARS_PER_TOKEN * self._holdback), 0)
        for start, end, open_end in _entity_runs(state.pending):
            if start < release and (end > release or (end == release and open_end)):
                return max(start, release - ENTITY_RUN_CAP)
            if start >= release:
                break
        return release

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


def _entity_runs(text: str) -> list[tuple[int, int, bool]]:
    """The entity-shaped runs of `text` as (start, end, open at the end), in offsets of `text` as written:
    words of `_RUN_WORD` (read normalised, as the recognisers read them, so full-width digits and
    zero-width characters inside count), and such words joined by one space where one is all digits
    and the other too or at most `_GROUP` long, or the first is an IBAN's head and the second at most
    `_GROUP` long: card numbers, IBANs ("gb82 west 1234 5698"), SSNs and phone numbers as they are
    written. Words joined by spaces are otherwise not one run, so prose (and "t1 t2 t3") streams.
    A run is open at the end when what follows it may still extend it: nothing yet, or one space."""
    plain = normalise(text)
    words = [(m.start(), m.end()) for m in _RUN_WORD.finditer(plain.text)]
    runs: list[tuple[int, int, bool]] = []
    i = 0
    while i < len(words):
        start, end = words[i]
        while i + 1 < len(words) and _joined(plain.text, words[i], words[i + 1]):
            i += 1
            end = words[i][1]
        i += 1
        s, e = plain.span(start, end)
        runs.append((s, e, plain.text[end:] in ("", " ")))
    return runs


def _joined(text: str, left: tuple[int, int], right: tuple[int, int]) -> bool:
    if text[left[1]:right[0]] != " ":
        return False
    a, b = text[left[0]:left[1]], text[right[0]:right[1]]
    if any(_DIGITS.fullmatch(x) and (_DIGITS.fullmatch(y) or len(y) <= _GROUP) for x, y in ((a, b), (b, a))):
        return True
    return _IBAN_HEAD.fullmatch(a) is not None and len(b) <= _GROUP

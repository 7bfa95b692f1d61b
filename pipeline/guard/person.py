"""Person names: spaCy's NER, cleaned of its commonest mistakes, plus names it cannot see.

spaCy's small English model reads capital letters as the main sign of a name, so it misses names
written in lower case ("forward this to siobhan o'reilly") and now and then takes a capitalised
imperative for one ("Convert 3.14159 to a fraction" came back as PERSON). Two recognisers fix that:

- `NerPersonRecognizer` keeps spaCy's PERSON spans but trims a leading base-form verb (tag VB) and
  any token holding a digit, and drops what is left if it holds no letter-only token or is one
  all-capitals token ("JSON").
- `NameListRecognizer` finds a first name followed by a surname, in any case, from the US Census name
  lists shipped in the `names` package (MIT; the census data is public domain: 5,494 first names,
  88,799 surnames), and a name after a phrase that introduces one ("my name is", "dear", "mr", "regards").

Both read the spaCy tokens of the NLP pass the analyzer has already made: no second pass.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable

from pipeline.guard.embedder import package_dir
from pipeline.guard.presidio_lean import (
    STOP_WORDS,
    Doc,
    LocalRecognizer,
    NlpArtifacts,
    RecognizerResult,
    SpacyRecognizer,
    Token,
)

NAMES_PACKAGE = "names"
# Words that introduce the name right after them; the next one or two name-shaped tokens are taken.
# ("i am", "called" and "named" were left out: "i am hungry", "a variable named total").
_INTRODUCERS = (("my", "name", "is"), ("dear",), ("mr",), ("mrs",), ("ms",), ("dr",), ("prof",), ("regards",), ("sincerely",))
_NOT_NAMES = STOP_WORDS | {"please", "thanks", "hello", "hi", "hey", "ok", "okay", "yes", "no", "sir", "madam", "team",
                           "all", "everyone", "guys", "there", "again", "so", "just", "here", "sorry", "not", "going"}
LIST_SCORE = 0.7  # a first name and a surname from the lists
INTRODUCED_SCORE = 0.75  # a name-shaped token after "my name is", "dear", ...


def fold(word: str) -> str:
    """Lower case, accents and apostrophes removed: "O'Reilly" -> "oreilly", "Søren" -> "soren"."""
    decomposed = unicodedata.normalize("NFKD", word.lower().replace("ø", "o").replace("ł", "l"))
    return "".join(c for c in decomposed if c.isalpha() and not unicodedata.combining(c))


@functools.cache
def census_names() -> tuple[frozenset[str], frozenset[str]]:
    """(first names, surnames), folded."""
    root = package_dir(NAMES_PACKAGE)

    def read(*files: str) -> frozenset[str]:
        return frozenset(fold(line.split()[0]) for f in files for line in (root / f).read_text().splitlines() if line.strip())

    return read("dist.female.first", "dist.male.first"), read("dist.all.last")


def _name_shaped(token: Token) -> bool:
    """Letters (an apostrophe or hyphen inside allowed), not a stop word, not all capitals."""
    text = token.text
    return (len(fold(text)) >= 2 and all(c.isalpha() or c in "'-’" for c in text) and text[0].isalpha()
            and text.lower() not in _NOT_NAMES and not (text.isupper() and len(text) > 1))


def _result(recognizer: LocalRecognizer, start: int, end: int, score: float) -> RecognizerResult:
    return RecognizerResult("PERSON", start, end, score, recognition_metadata={
        RecognizerResult.RECOGNIZER_NAME_KEY: recognizer.name, RecognizerResult.RECOGNIZER_IDENTIFIER_KEY: recognizer.id,
    })


class NerPersonRecognizer(SpacyRecognizer):
    """spaCy's PERSON spans without a leading imperative verb or numbers. `tag` gives a document its
    part-of-speech tags when a PERSON span needs them (pii.py runs the tagger only then); None: the
    pipeline tagged every document already."""

    def __init__(self, tag: Callable[[Doc], None] | None = None) -> None:
        super().__init__(supported_entities=["PERSON"])
        self._tag = tag

    def analyze(self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None) -> list[RecognizerResult]:
        if not nlp_artifacts or "PERSON" not in entities:
            return []
        out = []
        for span, score in zip(nlp_artifacts.entities, nlp_artifacts.scores):
            if span.label_ != "PERSON":
                continue
            if self._tag is not None and not span.doc.has_annotation("TAG"):
                self._tag(span.doc)
            tokens = [t for t in span if not any(c.isdigit() for c in t.text)]
            while tokens and tokens[0].tag_ == "VB":
                tokens = tokens[1:]
            if len(tokens) == 1 and tokens[0].is_upper:  # "JSON", "SQL": acronyms, not names
                continue
            if tokens and any(t.is_alpha for t in tokens):
                out.append(_result(self, tokens[0].idx, tokens[-1].idx + len(tokens[-1].text), score))
        return out


class NameListRecognizer(LocalRecognizer):
    """First name + surname from the census lists, in any case; a name after an introducing phrase."""

    def __init__(self) -> None:
        super().__init__(supported_entities=["PERSON"], name="NameListRecognizer", supported_language="en")
        self._first, self._last = census_names()

    def load(self) -> None:  # the lists are read in __init__
        pass

    def analyze(self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None) -> list[RecognizerResult]:
        if not nlp_artifacts or "PERSON" not in entities:
            return []
        tokens = list(nlp_artifacts.tokens)
        out = []
        for i, token in enumerate(tokens):
            if self._introduced(tokens, i) and _name_shaped(token):
                end = tokens[i + 1] if i + 1 < len(tokens) and _name_shaped(tokens[i + 1]) else token
                out.append(_result(self, token.idx, end.idx + len(end.text), INTRODUCED_SCORE))
            elif (i + 1 < len(tokens) and _name_shaped(token) and _name_shaped(tokens[i + 1])
                  and fold(token.text) in self._first and fold(tokens[i + 1].text) in self._last):
                end = tokens[i + 1]
                out.append(_result(self, token.idx, end.idx + len(end.text), LIST_SCORE))
        return out

    @staticmethod
    def _introduced(tokens: list[Token], i: int) -> bool:
        before = [t.lower_.rstrip(".") for t in tokens[max(0, i - 3) : i] if t.text not in (",", ":")]
        return any(tuple(before[-len(p) :]) == p for p in _INTRODUCERS)

"""Text as the PII recognisers should read it, with the way back to the original's offsets (pure; no models).

Full-width forms ("４１１１", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ") and invisible characters inside an entity
("john\\u200b@example.com") kept Presidio's patterns from matching. The recognisers therefore read the
text with each character put in NFKC form and the invisible ones removed, and each finding is mapped back
to the span of the original that produced it: redaction replaces what the user typed, full-width digits
and zero-width pieces included. Unlike `visible.py` (for the injection check, which only counts and
matches words), nothing here may move an offset without recording where it came from.

NFKC is applied character by character, so every character of the result comes from exactly one
character of the original ("ﬁ" gives "fi", both from the ligature); whole-text NFKC would also compose
sequences, which no recogniser needs and which would blur that map.
"""

from __future__ import annotations

import functools
import re
import unicodedata

__all__ = ["Normalised", "normalise"]

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): what a renderer shows as nothing.
# Zero-width space, joiners and non-joiner, word joiner, BOM, soft hyphen, bidi marks and controls,
# invisible operators, variation selectors, the Hangul fillers, tag characters. The format characters
# that do show (U+0600-0605 and the like, Arabic and Kaithi number signs) are not among them.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164"
    "\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


@functools.lru_cache(maxsize=4096)  # a text repeats few distinct characters; bounded against one made of many
def _fold(char: str) -> str:
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", char))


class Normalised:
    """A text as the recognisers read it (`text`) and where each of its characters came from."""

    __slots__ = ("_size", "_sources", "text")

    def __init__(self, text: str, sources: list[int] | None, size: int) -> None:
        self.text = text
        self._sources = sources  # index in the original of each character of `text`; None: `text` is the original
        self._size = size  # length of the original

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original's [start, end) that `text[start:end]` came from: from the source of its first
        character to the end of the source of its last, so the invisible characters inside it and the
        whole of a character NFKC expanded are covered."""
        if self._sources is None:
            return start, end
        at = self._sources[start] if start < len(self._sources) else self._size
        if end <= start:
            return at, at
        return at, self._sources[end - 1] + 1


def normalise(text: str) -> Normalised:
    """`text` with each character in NFKC form and the invisible ones removed. Plain ASCII, and any text
    already in NFKC with nothing invisible (accents, curly quotes, CJK), is returned as it is, with no map."""
    if text.isascii() or (unicodedata.is_normalized("NFKC", text) and not _INVISIBLE.search(text)):
        return Normalised(text, None, len(text))
    parts: list[str] = []
    sources: list[int] = []
    at = 0
    for run in _NON_ASCII.finditer(text):  # ASCII runs are copied whole; only the rest is looked at
        parts.append(text[at : run.start()])
        sources.extend(range(at, run.start()))
        for i in range(run.start(), run.end()):
            folded = _fold(text[i])
            parts.append(folded)
            sources.extend([i] * len(folded))
        at = run.end()
    parts.append(text[at:])
    sources.extend(range(at, len(text)))
    return Normalised("".join(parts), sources, len(text))

"""Text as its reader sees the words, for the guards' word counts and patterns (pure; no models)."""

from __future__ import annotations

import re
import unicodedata

# Characters that show as nothing or as a space but are not whitespace to `str.split` or `\s`: Unicode's
# format characters (category Cf: zero-width space and joiners, soft hyphen, bidi controls, tags...) and
# the Hangul fillers and the braille blank.
_BLANKS = re.compile(
    "[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064"
    "\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f\u115f\u1160\u3164\uffa0\u2800]"
)


def visible(text: str) -> str:
    """`text` as its reader sees the words: NFKC, invisible separators as spaces, and underscores too in
    a text with no whitespace at all ("Ignore_all_previous_instructions"). Counting words or matching
    patterns on the raw text let an injection glued with zero-width spaces, fillers or underscores pass
    as one word, which the classifier is never asked about."""
    if not text.isascii():
        text = _BLANKS.sub(" ", unicodedata.normalize("NFKC", text))
    if "_" in text and not any(ch.isspace() for ch in text):
        text = text.replace("_", " ")
    return text


__all__ = ["visible"]

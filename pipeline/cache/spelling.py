"""Spelling slips in a question, corrected before the semantic tier embeds and summarises it.

MiniLM splits a word it does not know into pieces, so one slip moves a short question far: "Where can I find
my invioce history?" sits at 0.64 cosine from "... invoice history?", below any safe threshold, and the
trap check counts "invioce" as a word the other side lacks. `corrected(text)` replaces each word that is not
in an English word list by the most frequent of the `COMMON` most frequent words one edit away (a letter
dropped, added, changed, or two neighbours swapped), when there is one:

- only words of `MIN_LETTERS`+ letters, all lower case or the text's capitalised first word: names and
  acronyms (Gmail, HubSpot, NHS) are left as they are, since the trap check reads them as names;
- the correction keeps the first letter (people rarely slip on it, and "gmail" is not "email");
- a word of fewer than 6 letters is only given a dropped letter back or two swapped letters put back
  ("aply": apply, "chlid": child); longer words take any one edit. "repo" stays "repo", not "rep" or "reno";
- words with an apostrophe, a digit or a letter outside a-z are left alone ("shouldn't" is not "should" and
  "t", "Straße" is not "Star" and "e");
- a listed word is never changed, so real words one letter apart (puppy/poppy, cheap/cheat) stay apart;
- only a common word is a correction: a slip is likelier in a common word, and an unlisted abbreviation
  ("repo") is not turned into a rare word ("repro", the 24,854th).

The word list is the frequency dictionary that the `symspellpy==6.10.1` package ships (82,765 English words
with counts, MIT licence; its code is not imported). It is read once per process, by `load()` or on the first
call (about 0.1 s, about 11 MB). Without the package no word is corrected. A corrected question is used only
for the semantic tier's vector and summary; the exact tier keys the text as sent.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["COMMON", "MIN_LETTERS", "corrected", "load"]

MIN_LETTERS = 4
COMMON = 20_000  # the words a slip may be corrected to: this many of the most frequent (count >= 1.2 million)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORD = re.compile(r"\w+(?:['\u2019]\w+)*")  # "shouldn't", "café", "order2" are one word each
DICTIONARY = "frequency_dictionary_en_82_765.txt"


@dataclass(frozen=True)
class Words:
    listed: frozenset[str]  # every word of the list: never corrected
    common: dict[str, int]  # the COMMON most frequent -> their counts: what a slip is corrected to


def load() -> bool:
    """Reads the word list now rather than on the first question; False when `symspellpy` is not installed."""
    return bool(_words().listed)


def corrected(text: str) -> str:
    """The text with each unlisted lower-case word (and a capitalised first word) of `MIN_LETTERS`+ letters
    replaced by the most frequent common word one edit away that keeps its first letter, if any."""
    words = _words()
    if not words.listed:
        return text
    start = first.start() if (first := WORD.search(text)) else -1

    def fix(match: re.Match[str]) -> str:
        word = match[0]
        if not (word.isascii() and word.isalpha()):  # a contraction, a code with digits, another alphabet
            return word
        if word.islower():
            return _correction(word, words)
        if match.start() == start and word[0].isupper() and word[1:].islower():
            fixed = _correction(word.lower(), words)
            return fixed[0].upper() + fixed[1:]
        return word

    return WORD.sub(fix, text)


def _correction(word: str, words: Words) -> str:
    if len(word) < MIN_LETTERS or word in words.listed:
        return word
    found = [(words.common[c], c) for c in _edits(word) if c in words.common and c[0] == word[0]]
    return max(found)[1] if found else word


def _edits(word: str) -> set[str]:
    """The strings one edit away: a letter inserted or two neighbours swapped; from 6 letters on, also a
    letter deleted or changed."""
    splits = [(word[:i], word[i:]) for i in range(len(word) + 1)]
    out = {a + c + b for a, b in splits for c in LETTERS} | {a + b[1] + b[0] + b[2:] for a, b in splits if len(b) > 1}
    if len(word) >= 6:
        out |= {a + b[1:] for a, b in splits if b} | {a + c + b[1:] for a, b in splits if b for c in LETTERS}
    return out


@lru_cache(maxsize=1)
def _words() -> Words:
    spec = importlib.util.find_spec("symspellpy")
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / DICTIONARY if spec else None
    if path is None or not path.is_file():
        return Words(frozenset(), {})
    counts = [(word, int(count)) for word, _, count in (line.partition(" ") for line in
              path.read_text(encoding="utf-8").splitlines()) if word.isalpha() and count.isdigit()]
    counts.sort(key=lambda wc: -wc[1])  # the file is in this order already; do not depend on it
    return Words(frozenset(w for w, _ in counts), dict(counts[:COMMON]))

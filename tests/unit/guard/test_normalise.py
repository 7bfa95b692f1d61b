"""The text the PII recognisers read: NFKC per character, invisible characters removed, and every
character traced back to the one it came from (no models)."""

from __future__ import annotations

import pytest

from pipeline.guard.normalise import normalise


@pytest.mark.parametrize("text", ["", "Write to jane.doe@example.org today.", "Contact José Álvarez, “quoted”, 東京 +49 30 1234567"])
def test_plain_or_already_normal_text_is_returned_as_it_is_with_no_map(text: str) -> None:
    plain = normalise(text)
    assert plain.text is text and plain._sources is None
    assert plain.span(3, 7) == (3, 7)


def test_full_width_forms_become_ascii_one_for_one() -> None:
    text = "card ４１１１ １１１１, mail ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ"
    plain = normalise(text)
    assert plain.text == "card 4111 1111, mail john@example.com"
    start = plain.text.index("john")
    assert plain.span(start, start + len("john@example.com")) == (text.index("ｊ"), len(text))


@pytest.mark.parametrize("invisible", ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u202e", "\U000e0041"])
def test_invisible_characters_are_removed_and_spans_cover_them(invisible: str) -> None:
    text = f"to john{invisible}@exam{invisible}{invisible}ple.com now"
    plain = normalise(text)
    assert plain.text == "to john@example.com now"
    start, end = plain.span(3, 3 + len("john@example.com"))
    assert text[start:end] == f"john{invisible}@exam{invisible}{invisible}ple.com"


def test_a_format_character_that_shows_is_kept() -> None:
    assert normalise("\u0600 1 x\u200b").text == "\u0600 1 x"  # the Arabic number sign is drawn; U+200B is not


def test_an_expanding_character_maps_every_piece_back_to_it() -> None:
    text = "ﬁle ｊｏｈｎ＠ｘ.io ﬃ"
    plain = normalise(text)
    assert plain.text == "file john@x.io ffi"
    assert [plain.span(i, i + 1) for i in range(2)] == [(0, 1), (0, 1)]  # "f" and "i" both come from "ﬁ"
    assert plain.span(0, 4) == (0, 3)
    mail = plain.text.index("john")
    assert text[slice(*plain.span(mail, mail + len("john@x.io")))] == "ｊｏｈｎ＠ｘ.io"
    assert plain.span(len(plain.text) - 2, len(plain.text) - 1) == (len(text) - 1, len(text))  # inside "ﬃ": all of it
    assert plain.span(len(plain.text), len(plain.text)) == (len(text), len(text))


def test_a_character_that_is_only_invisible_after_nfkc_is_removed_too() -> None:
    assert normalise("a\uffa0b").text == "ab"  # the half-width Hangul filler: NFKC gives U+1160, also a filler

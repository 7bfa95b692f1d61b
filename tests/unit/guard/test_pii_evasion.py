"""PII written to slip past the recognisers: full-width forms and invisible characters inside an
address or a number. The input guard and the output scanner read it normalised (normalise.py) and
redact or block the text as it was written, every piece of it."""

from __future__ import annotations

import pytest

from pipeline.errors import StageError
from pipeline.guard.errors import Reason
from pipeline.guard.loader import InputGuard, TextCheck
from pipeline.guard.pii import Finding, PatternScanner
from pipeline.guard.redact import Placeholders, apply_policy
from pipeline.guard.slices import PII_OVERLAP, PII_SLICE
from pipeline.guard.stream_check import StreamState
from tests.unit.fakes import run_handler
from tests.unit.guard.test_guard_stage import admitted
from tests.unit.guard.test_guard_stage import stage as guard_stage
from tests.unit.guard.test_pii import SAMPLES
from tests.unit.guard.test_postguard import done, feed, texts
from tests.unit.guard.test_postguard import stage as postguard_stage

ZW = "\u200b"
EVASIONS = {  # text -> (entity, what the user typed for it)
    "My card number is ４１１１ １１１１ １１１１ １１１１ thanks.": ("CREDIT_CARD", "４１１１ １１１１ １１１１ １１１１"),
    "Write to ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ today.": ("EMAIL", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ"),
    f"Write to john{ZW}@example.com today.": ("EMAIL", f"john{ZW}@example.com"),
    f"My card number is 4111{ZW}1111{ZW}1111{ZW}1111 thanks.": ("CREDIT_CARD", f"4111{ZW}1111{ZW}1111{ZW}1111"),
    "My card number is 4111\u00ad1111\u20601111\ufeff1111 thanks.": ("CREDIT_CARD", "4111\u00ad1111\u20601111\ufeff1111"),
    "Call me on +44 20 7946\ufeff0958 after six.": ("PHONE", "+44 20 7946\ufeff0958"),
    "Call me on +1 212\u200d555\u200c0199 after six.": ("PHONE", "+1 212\u200d555\u200c0199"),
}

NAMES = ["card-full-width", "email-full-width", "email-zwsp", "card-zwsp", "card-shy-wj-bom", "phone-bom", "phone-zwj-zwnj"]


def found(findings: list[Finding], text: str) -> list[tuple[str, str]]:
    return [(f.entity, text[f.start : f.end]) for f in findings]


def screened(guard: InputGuard, text: str) -> list[Finding]:
    [[verdict]] = guard.check([[TextCheck(text, False)]])
    return verdict.findings


@pytest.mark.parametrize("text", list(EVASIONS), ids=NAMES)
def test_the_input_guard_finds_the_entity_as_it_was_written_and_redacts_all_of_it(input_guard: InputGuard, text: str) -> None:
    entity, typed = EVASIONS[text]
    findings = screened(input_guard, text)
    assert (entity, typed) in found(findings, text)
    assert apply_policy(text, findings, {}, Placeholders()).text == text.replace(typed, f"<{entity}_1>")


@pytest.mark.parametrize("text", list(EVASIONS), ids=NAMES)
def test_the_output_scanner_finds_the_entity_as_it_was_written(text: str) -> None:
    entity, typed = EVASIONS[text]
    assert (entity, typed) in found(PatternScanner().scan(text), text)


def test_a_long_text_maps_a_finding_back_through_its_slice(input_guard: InputGuard) -> None:
    text = "Some words to fill the slice. " * 60 + "ﬁnally write to ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ, please."
    assert ("EMAIL", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ") in found(screened(input_guard, text), text)


def test_invisible_padding_cannot_stretch_an_entity_past_the_slices_overlap(input_guard: InputGuard) -> None:
    padded = (ZW * 5).join("maria.lopez@example.com")  # 133 characters as written, 23 as read
    text = "Some words to fill the slice. " * 29 + "Mail " + padded + " and more words after it. " * 40
    assert text.index(padded) < PII_SLICE - PII_OVERLAP and text.index(padded) + len(padded) > PII_SLICE  # in no slice whole, as written
    findings = screened(input_guard, text)
    assert ("EMAIL", padded) in found(findings, text)
    assert "<EMAIL_1>" in apply_policy(text, findings, {}, Placeholders()).text


def test_an_expanded_character_before_an_entity_does_not_shift_it(input_guard: InputGuard) -> None:
    text = "ﬁ ﬃ ㎏ mail ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ or jane.doe@example.org"
    expected = [("EMAIL", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ"), ("EMAIL", "jane.doe@example.org")]
    assert found(screened(input_guard, text), text) == expected
    assert found(PatternScanner().scan(text), text) == expected


def test_one_address_written_two_ways_gets_one_placeholder(input_guard: InputGuard) -> None:
    text = f"Mail ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ or john@example.com or jo{ZW}hn@example.com."
    assert apply_policy(text, screened(input_guard, text), {}, Placeholders()).text == "Mail <EMAIL_1> or <EMAIL_1> or <EMAIL_1>."


@pytest.mark.parametrize("entity", list(SAMPLES))
def test_plain_ascii_text_gives_the_same_findings_as_before(input_guard: InputGuard, entity: str) -> None:
    text = SAMPLES[entity]
    spans = {f.entity: text[f.start : f.end] for f in screened(input_guard, text)}
    assert spans[entity] == {
        "EMAIL": "jane.doe@example.org", "PHONE": "+1 212-555-0199", "CREDIT_CARD": "4111 1111 1111 1111",
        "IBAN": "DE89 3704 0044 0532 0130 00", "IP_ADDRESS": "203.0.113.42", "US_SSN": "536-22-8761", "PERSON": "Barack Obama",
        "API_KEY": "sk-proj-Zx81kQw2LmN0pRt5VbY7cD3eFgH9", "PRIVATE_KEY": SAMPLES["PRIVATE_KEY"][len("Here is my key:\n"):-len("\nkeep it safe")],
    }[entity]


@pytest.mark.asyncio
async def test_the_guard_stage_blocks_a_full_width_card_and_redacts_split_addresses(input_guard: InputGuard) -> None:
    with pytest.raises(StageError) as caught:
        await run_handler(guard_stage(input_guard, pii={"CREDIT_CARD": "block"}, injection_threshold=1.0),
                          admitted("Charge ４１１１ １１１１ １１１１ １１１１ now."))
    assert caught.value.message.startswith("pii_blocked:") and "CREDIT_CARD" in caught.value.message
    [out] = await run_handler(guard_stage(input_guard), admitted(f"My email is jane.doe{ZW}@example.org, phone +44 20 7946\ufeff0958."))
    assert out.value.request.messages[0].content == "My email is <EMAIL_1>, phone <PHONE_1>."


@pytest.mark.asyncio
@pytest.mark.parametrize(("words", "expected"), [
    (["Write ", "to ", "jane", ZW, ".doe@", "example", f"{ZW}.org ", "for ", "details ", "about ", "it", "."],
     "Write to <EMAIL_1> for details about it."),
    (["Card: ", "4111", f"{ZW}1111", f"{ZW}11", f"11{ZW}", "1111", " is ", "on ", "file ", "now", "."], "Card: <CREDIT_CARD_1> is on file now."),
    (["Call ", "+44 ", "20 ", "7946", "\ufeff", "0958 ", "after ", "six ", "today", "."], "Call <PHONE_1> after six today."),
    (["Mail ", "ｊｏｈｎ", "＠ｅｘａｍｐｌｅ", "．ｃｏｍ", " or ", "john@", "example.com", " now", "."], "Mail <EMAIL_1> or <EMAIL_1> now."),
], ids=["email-zwsp", "card-zwsp", "phone-bom", "email-full-width"])
async def test_the_stream_redacts_an_entity_split_by_invisible_characters_across_chunks(make_output_guard, words: list[str], expected: str) -> None:  # type: ignore[no-untyped-def]
    guard = postguard_stage(make_output_guard, holdback_tokens=4)
    assert texts(await feed(guard, words, done(len(words), words=words))) == expected


@pytest.mark.asyncio
async def test_the_stream_never_releases_a_split_entity_in_part(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = postguard_stage(make_output_guard)  # the default holdback
    text = f"Pay ４１１１{ZW}1111 1111 1111.john{ZW}@example.com thanks a lot for all of it, and have a good day now."
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    released = texts(await feed(guard, pieces, done(len(pieces), words=pieces)))
    # the card and the address run into each other: one placeholder over both, named for the longer
    assert released == "Pay <EMAIL_1> thanks a lot for all of it, and have a good day now.", released


def test_a_blocked_entity_split_by_invisible_characters_ends_the_stream_before_it(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = make_output_guard(holdback_tokens=4)
    state = StreamState({"CREDIT_CARD": "block"})
    released, violation = "", None
    for word in ["Here ", "it ", "is: ", "4111", f"{ZW}1111", f"{ZW}1111", f"{ZW}1111", " and ", "more ", "text ", "here", "."]:
        step = guard.push(state, word)
        released += step.release
        if (violation := step.violation) is not None:
            break
    assert violation is Reason.output_pii and released == "Here it is: "

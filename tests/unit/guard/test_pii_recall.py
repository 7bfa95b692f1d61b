"""PII in the shapes people really type: names in lower case and from other languages, IBANs in any
case and spacing, SSNs without separators when the text says so, international phone numbers; and
capitalised verbs and numbers that are not names. The labelled set's figures are in guardrails.md."""

from __future__ import annotations

import pytest

from bench.pii_accuracy import load, score
from pipeline.guard.loader import InputGuard, TextCheck


def found(guard: InputGuard, text: str) -> list[tuple[str, str]]:
    [[verdict]] = guard.check([[TextCheck(text, False)]])
    return [(f.entity, text[f.start : f.end]) for f in verdict.findings]


@pytest.mark.parametrize(("text", "name"), [
    ("please forward this to siobhan o'reilly in accounting", "siobhan o'reilly"),
    ("ask bill gates whether the release is ready", "bill gates"),
    ("my name is kenji watanabe and i need help", "kenji watanabe"),
    ("Contact José Álvarez for the keys.", "José Álvarez"),
])
def test_names_in_lower_case_and_other_languages(input_guard: InputGuard, text: str, name: str) -> None:
    assert ("PERSON", name) in found(input_guard, text)


@pytest.mark.parametrize("text", ["Ping the server every five seconds.", "Convert 3.14159 to a fraction.", "Parse the JSON and print every key.",
                                  "the grace period ends on monday", "Sort these names alphabetically."])
def test_verbs_numbers_and_acronyms_are_not_names(input_guard: InputGuard, text: str) -> None:
    assert [e for e, _ in found(input_guard, text) if e == "PERSON"] == []


@pytest.mark.parametrize(("text", "iban"), [
    ("my iban is gb82 west 1234 5698 7654 32, thanks", "gb82 west 1234 5698 7654 32"),
    ("IBAN: fr1420041010050500013m02606", "fr1420041010050500013m02606"),
    ("Überweisung an AT61 1904 3002 3457 3201 bitte.", "AT61 1904 3002 3457 3201"),
])
def test_ibans_in_any_case_and_spacing(input_guard: InputGuard, text: str, iban: str) -> None:
    assert ("IBAN", iban) in found(input_guard, text)


def test_an_ssn_without_separators_needs_its_context(input_guard: InputGuard) -> None:
    assert ("US_SSN", "536228761") in found(input_guard, "my ssn is 536228761")
    assert ("US_SSN", "412567890") in found(input_guard, "social security number 412567890 for the form")
    assert found(input_guard, "Order 536228761 shipped on Tuesday.") == []


@pytest.mark.parametrize("phone", ["+44 20 7946 0958", "+33 6 12 34 56 78", "+81 3-1234-5678", "+86 138 0013 8000", "+91 98765 43210",
                                   "+55 11 91234-5678", "+353 1 234 5678"])
def test_international_phone_numbers(input_guard: InputGuard, phone: str) -> None:
    assert ("PHONE", phone) in found(input_guard, f"You can reach me at {phone} any time.")


def test_recall_and_precision_on_the_labelled_set(input_guard: InputGuard) -> None:
    items = load()
    [verdicts] = input_guard.check([[TextCheck(i.text, False) for i in items]])
    tp, fp, fn, errors = score(items, [v.findings for v in verdicts])
    recall = sum(tp.values()) / (sum(tp.values()) + sum(fn.values()))
    precision = sum(tp.values()) / (sum(tp.values()) + sum(fp.values()))
    assert len(items) >= 100
    assert recall >= 0.95 and precision >= 0.90, errors


def test_a_leading_imperative_is_cut_from_a_name_though_only_texts_with_a_person_are_tagged(input_guard: InputGuard) -> None:
    """The tagger runs lazily (pii.py): its tags must still reach the PERSON check, and a text without a
    person must not be tagged at all."""
    assert ("PERSON", "Maria Garcia") in found(input_guard, "Invite Maria Garcia to the call.")
    nlp = input_guard.pii._nlp.nlp["en"]  # type: ignore[attr-defined]
    assert "tagger" not in nlp.pipe_names and not nlp("What is the capital of France?").has_annotation("TAG")


@pytest.mark.parametrize("text", ["call 030 1234 today", "+49 30 1234567", "my number is 212-555-0199"])
def test_short_phone_numbers_pass_the_digit_gate(input_guard: InputGuard, text: str) -> None:
    assert "PHONE" in [e for e, _ in found(input_guard, text)]

"""The PII analyzer with the real Presidio and spaCy model, and each policy: allow, redact, block."""

from __future__ import annotations

import logging

import pytest

from pipeline.guard.loader import InputGuard, TextCheck
from pipeline.guard.pii import PatternScanner
from pipeline.guard.redact import Placeholders, apply_policy

PRIVATE_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7bq9\nQ2xvdWQ=\n-----END RSA PRIVATE KEY-----"
SAMPLES = {
    "EMAIL": "Write to jane.doe@example.org today.",
    "PHONE": "Call me on +1 212-555-0199 after six.",
    "CREDIT_CARD": "My card number is 4111 1111 1111 1111.",
    "IBAN": "Send it to DE89 3704 0044 0532 0130 00 please.",
    "IP_ADDRESS": "The server answers on 203.0.113.42 only.",
    "US_SSN": "My social security number is 536-22-8761.",
    "PERSON": "Yesterday Barack Obama visited the museum.",
    "API_KEY": "Use the key sk-proj-Zx81kQw2LmN0pRt5VbY7cD3eFgH9 for the call.",
    "PRIVATE_KEY": f"Here is my key:\n{PRIVATE_KEY}\nkeep it safe",
}


def findings(guard: InputGuard, text: str) -> list[str]:
    [[verdict]] = guard.check([[TextCheck(text, False)]])
    return [f.entity for f in verdict.findings]


@pytest.mark.parametrize("entity", list(SAMPLES))
def test_each_recogniser_finds_its_entity(input_guard: InputGuard, entity: str) -> None:
    assert entity in findings(input_guard, SAMPLES[entity])


def test_a_card_number_failing_the_checksum_is_not_a_card(input_guard: InputGuard) -> None:
    assert "CREDIT_CARD" not in findings(input_guard, "My card number is 4111 1111 1111 1112.")


def test_ordinary_text_has_no_findings(input_guard: InputGuard) -> None:
    assert findings(input_guard, "How do I make a good risotto with mushrooms and parmesan?") == []


def test_amounts_and_counts_are_screened_without_a_warning_each(
    input_guard: InputGuard, caplog: pytest.LogCaptureFixture
) -> None:
    """spaCy tags "300 dollars" MONEY and "two" CARDINAL; Presidio maps neither and used to log a warning
    for each, on every call, while keeping them for recognisers that never read them."""
    with caplog.at_level(logging.WARNING, logger="presidio-analyzer"):
        assert findings(input_guard, "I paid 300 dollars for two tickets, 40 percent more than in 2019.") == []
    assert [r.getMessage() for r in caplog.records if r.name == "presidio-analyzer"] == []


def test_allow_leaves_the_text_alone(input_guard: InputGuard) -> None:
    text = SAMPLES["EMAIL"]
    [[verdict]] = input_guard.check([[TextCheck(text, False)]])
    result = apply_policy(text, verdict.findings, {"EMAIL": "allow"}, Placeholders())
    assert result.text == text and result.redacted == 0 and result.blocked == ()


def test_redact_uses_typed_numbered_placeholders_stable_per_value(input_guard: InputGuard) -> None:
    text = "Mail a@example.com and b@example.com, then a@example.com again. Card 4111 1111 1111 1111."
    [[verdict]] = input_guard.check([[TextCheck(text, False)]])
    result = apply_policy(text, verdict.findings, {"EMAIL": "redact", "CREDIT_CARD": "redact"}, Placeholders())
    assert result.text == "Mail <EMAIL_1> and <EMAIL_2>, then <EMAIL_1> again. Card <CREDIT_CARD_1>."


def test_block_reports_the_entity(input_guard: InputGuard) -> None:
    text = SAMPLES["PRIVATE_KEY"]
    [[verdict]] = input_guard.check([[TextCheck(text, False)]])
    result = apply_policy(text, verdict.findings, {"PRIVATE_KEY": "block"}, Placeholders())
    assert result.blocked == ("PRIVATE_KEY",)


def test_one_batch_analyses_several_requests(input_guard: InputGuard) -> None:
    batch = [[TextCheck(SAMPLES["EMAIL"], False)], [TextCheck("Nothing here.", False), TextCheck(SAMPLES["US_SSN"], False)]]
    verdicts = input_guard.check(batch)
    assert [[[f.entity for f in v.findings] for v in r] for r in verdicts] == [[["EMAIL"]], [[], ["US_SSN"]]]


def test_the_pattern_scanner_finds_pattern_entities_without_nlp() -> None:
    found = [f.entity for f in PatternScanner().scan("mail jane.doe@example.org, key AKIAIOSFODNN7EXAMPLE")]
    assert found == ["EMAIL", "API_KEY"]


def test_overlapping_findings_each_count_a_block_is_never_hidden_and_redaction_covers_the_union() -> None:
    from pipeline.guard.pii import Finding

    text = "My card is 4111 1111 1111 1111.jane@example.org"
    card, mail = Finding("CREDIT_CARD", 11, 30, 1.0), Finding("EMAIL", 26, 47, 1.0)  # the e-mail's span is longer
    assert apply_policy(text, [card, mail], {"CREDIT_CARD": "block"}, Placeholders()).blocked == ("CREDIT_CARD",)
    redacted = apply_policy(text, [card, mail], {}, Placeholders()).text
    assert "4111" not in redacted and "example" not in redacted and redacted.startswith("My card is <")
    server = "server 2001:db8::1 415-555-2671"
    ip, phone = Finding("IP_ADDRESS", 7, 19, 0.6), Finding("PHONE", 18, 31, 0.4)  # an allowed finding over a blocked one
    assert apply_policy(server, [ip, phone], {"IP_ADDRESS": "allow", "PHONE": "block"}, Placeholders()).blocked == ("PHONE",)
    assert apply_policy(server, [ip, phone], {"IP_ADDRESS": "allow"}, Placeholders()).text == "server 2001:db8::1<PHONE_1>"


def test_a_pgp_private_key_block_is_a_private_key(input_guard: InputGuard) -> None:
    pgp = "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBF9aX8wBCAC5\n=abcd\n-----END PGP PRIVATE KEY BLOCK-----"
    assert "PRIVATE_KEY" in findings(input_guard, f"my key:\n{pgp}\nthanks")


def test_the_output_scanner_boosts_a_match_by_its_context_words_as_the_input_guard_does() -> None:
    scanner = PatternScanner()
    assert [f.entity for f in scanner.scan("Your SSN is 536228761, keep it safe.")] == ["US_SSN"]  # 0.05 alone
    assert scanner.scan("The order number is 536228761.") == []  # no context word: not an SSN


def test_the_output_scanner_reads_context_words_in_the_text_released_before() -> None:
    """postguard passes the open sentence's released text: "social security" may have left the window."""
    scanner = PatternScanner()
    [finding] = scanner.scan("is 536228761.", context="Your social security number, as recorded, ")
    assert (finding.entity, finding.start, finding.end) == ("US_SSN", 3, 12)  # offsets in the text, not the context
    assert scanner.scan("is 536228761.", context="Your order number, as recorded, ") == []


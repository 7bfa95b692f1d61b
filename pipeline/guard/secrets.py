"""Recognisers for secrets: API-key-shaped tokens and private key blocks (Presidio pattern recognisers)."""

from __future__ import annotations

from pipeline.guard.presidio_lean import Pattern, PatternRecognizer

_API_KEYS = (
    ("openai", r"\bsk-(?:proj-|live-|test-)?[A-Za-z0-9_-]{20,}", 0.9),
    ("aws_access_key_id", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0.9),
    ("github", r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})", 0.9),
    ("slack", r"\bxox[abposr]-[A-Za-z0-9-]{10,}", 0.9),
    ("google", r"\bAIza[0-9A-Za-z_-]{35}", 0.9),
    ("stripe", r"\b[rs]k_(?:live|test)_[0-9A-Za-z]{16,}", 0.9),
    ("jwt", r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}", 0.85),
    # `api_key = "…"`, `token: …`: the label and a long opaque value, redacted together.
    ("assignment", r"\b(?:api[_-]?key|secret[_-]?key|access[_-]?token|auth[_-]?token|client[_-]?secret|password)\b[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9_\-+/=.]{16,}", 0.7),
)
_PRIVATE_KEYS = (
    # PEM (RSA, EC, OPENSSH, ENCRYPTED...) and PGP's armour (`PRIVATE KEY BLOCK`)
    ("block", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----", 1.0),
    # The header alone: a streamed key is flagged before its body arrives.
    ("header", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----", 0.95),
)


def secret_recognizers() -> list[PatternRecognizer]:
    return [
        PatternRecognizer(
            supported_entity="API_KEY", name="ApiKeyRecognizer", supported_language="en",
            patterns=[Pattern(name, regex, score) for name, regex, score in _API_KEYS],
        ),
        PatternRecognizer(
            supported_entity="PRIVATE_KEY", name="PrivateKeyRecognizer", supported_language="en",
            patterns=[Pattern(name, regex, score) for name, regex, score in _PRIVATE_KEYS],
        ),
    ]

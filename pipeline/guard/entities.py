"""The PII entities the guards know and the actions a policy may take. No dependencies, so
`pipeline.settings` can validate policies without loading any model."""

from __future__ import annotations

from typing import Literal

Action = Literal["allow", "redact", "block"]

# Our entity names; they are also the placeholder labels (`<EMAIL_1>`) and the keys in [guard.pii].
ENTITIES: tuple[str, ...] = (
    "EMAIL", "PHONE", "CREDIT_CARD", "IBAN", "IP_ADDRESS", "US_SSN", "PERSON", "API_KEY", "PRIVATE_KEY",
)
# Found by patterns alone (no NLP pass): cheap enough to run on every chunk of the output stream.
PATTERN_ENTITIES: tuple[str, ...] = tuple(e for e in ENTITIES if e != "PERSON")

DEFAULT_POLICY: dict[str, Action] = {
    "EMAIL": "redact",
    "PHONE": "redact",
    "CREDIT_CARD": "redact",
    "IBAN": "redact",
    "IP_ADDRESS": "allow",  # networking questions quote addresses; a tenant may tighten this
    "US_SSN": "redact",
    "PERSON": "allow",  # names are everywhere in ordinary text; a tenant may tighten this
    "API_KEY": "redact",
    "PRIVATE_KEY": "block",
}

"""Guard errors. A blocked request is not an exception of this module: the stages raise
`pipeline.errors.StageError(content_filter, "<reason>: ...")` with a `Reason` from here.

    SluiceError (pipeline.errors)
    └── GuardError            the guards cannot run
        └── GuardModelMissing a model or weights file is not installed; raised at start-up only
"""

from __future__ import annotations

import enum

from pipeline.errors import SluiceError


class Reason(enum.StrEnum):
    """Why a guard stopped a request: the prefix of the client-visible error message."""

    pii_blocked = "pii_blocked"
    prompt_injection = "prompt_injection"
    toxicity = "toxicity"
    blocklist = "blocklist"
    output_pii = "output_pii"
    off_topic = "off_topic"


class GuardError(SluiceError):
    """The guards cannot run (a bug or a broken installation), as opposed to a verdict."""


class GuardModelMissing(GuardError):
    """A model package or the trained classifier weights are not where they should be."""

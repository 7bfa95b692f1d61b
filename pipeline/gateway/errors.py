"""The gateway's own errors.

    SluiceError
    └── StoreUnavailable   Redis did not answer: the gateway applies its configured failure mode
"""

from __future__ import annotations

from pipeline.errors import SluiceError


class StoreUnavailable(SluiceError):
    """A shared store (Redis) could not be reached or timed out; the message names no secret."""

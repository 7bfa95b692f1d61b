"""The gateway's own errors.

    SluiceError
    ├── StoreUnavailable   Redis did not answer: the gateway applies its configured failure mode
    └── KeyChanged         a key record was changed by someone else since it was read: nothing was written
"""

from __future__ import annotations

from pipeline.errors import SluiceError


class StoreUnavailable(SluiceError):
    """A shared store (Redis) could not be reached or timed out; the message names no secret."""


class KeyChanged(SluiceError):
    """`KeyStore.update` found another version of the record than the one its change was made from (a
    rotation racing a revocation or another rotation): it wrote nothing. Read the record and try again."""

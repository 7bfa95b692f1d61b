"""Batch errors, each with the HTTP status and error code the bridge answers with.

    SluiceError (pipeline.errors)
    └── BatchError
        ├── Invalid       400: a file or batch request sluice cannot take (empty, unreadable, wrong purpose)
        ├── NotFound      404: no such file or batch for this tenant (another tenant's looks the same)
        ├── TooLarge      413: a file over `batch.max_file_bytes`, or over the tenant's `batch.max_tenant_bytes`
        ├── TooMany       429: the tenant already has `batch.max_active_per_tenant` unfinished batches
        └── Conflict      409: the batch is already finished (cancel)
"""

from __future__ import annotations

from pipeline.errors import SluiceError
from topics.errors import ErrorCode


class BatchError(SluiceError):
    status = 400
    code = ErrorCode.invalid_request

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class Invalid(BatchError):
    pass


class NotFound(BatchError):
    status = 404
    code = ErrorCode.not_found


class TooLarge(BatchError):
    status = 413


class TooMany(BatchError):
    status = 429
    code = ErrorCode.rate_limited


class Conflict(BatchError):
    status = 409

"""What batch state is made of: file and batch records as stored, and their OpenAI JSON objects.

    FileRecord     one uploaded (or written) file: owner tenant, purpose, size; the bytes are on disk
    Batch          one job: owner, input file, endpoint, status and its timestamps, the output files
    Signer         who a job's lines run as: a key's hash or a JWT's claims (and its expiry), never a raw credential
    Recorded       one line's outcome, recorded once (the output or error line as it will be written)

Ids are generated here (`new_file_id`: random hex; `new_batch_id`: the creation second, then random hex,
so job ids sort oldest first and workers take waiting jobs in that order), never taken from a client,
and checked against their pattern before they are used as a path or a key (`valid_file_id`).
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
import time
from typing import Any, Literal

import msgspec

FILE_ID = re.compile(r"^file-[0-9a-f]{24}\Z")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}\Z")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class Status(enum.StrEnum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


TERMINAL = frozenset({Status.failed, Status.completed, Status.expired, Status.cancelled})
ACTIVE = frozenset(Status) - TERMINAL


class FileRecord(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    purpose: Literal["batch", "batch_output"]
    bytes: int
    created_at: int
    filename: str  # shown to the client only; never a path

    def to_openai(self, expires_at: int | None) -> dict[str, Any]:
        """`expires_at`: when the file is deleted (FileStore.expires_at); None: kept until deleted."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": expires_at, "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None}


class Signer(msgspec.Struct, frozen=True):
    """Who the job's requests run as (pipeline/gateway/principal.py signs each one with the gateway secret)."""

    kind: Literal["key", "jwt"]
    subject: str  # key: its SHA-256 (ingest looks it up, so a revoked key stops the job); jwt: `sub`
    tenant: str | None = None  # jwt: the verified tenant claim
    models: tuple[str, ...] = ()  # jwt: the verified models claim
    # jwt: its `exp` plus the leeway (unix seconds); no line is signed from then on (service.signer_for).
    # None on a jwt: a record written before this field, whose expiry is unknown: taken as expired, since
    # running it could act as the user for the whole completion window. Keys: None (ingest looks them up).
    expires_at: float | None = None

    def expired(self, now: float) -> bool:
        """Whether lines may no longer be signed as this owner (a key never expires here)."""
        return self.kind == "jwt" and (self.expires_at is None or now >= self.expires_at)


class BatchError(msgspec.Struct, frozen=True):
    """One entry of the batch object's `errors.data`."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class Counts(msgspec.Struct, frozen=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    created_at: int
    expires_at: int
    status: Status = Status.validating
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    signer: Signer | None = None  # None: anonymous (gateway.auth_required is false)
    total: int = 0  # lines in the input file, set when validation ends
    ending: Status | None = None  # while finalizing: the status it ends in (completed, or expired)
    errors: tuple[BatchError, ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def to_openai(self, counts: Counts) -> dict[str, Any]:
        errors = {"object": "list", "data": [msgspec.to_builtins(e) for e in self.errors]} if self.errors else None
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.value, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": counts.total or self.total, "completed": counts.completed, "failed": counts.failed},
            "metadata": self.metadata,
        }


class Recorded(msgspec.Struct, frozen=True, array_like=True):
    """One line's outcome as stored: its line number (1-based), whether it succeeded, and the JSON line."""

    line: int
    ok: bool
    text: bytes


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    """`batch_`, the creation second (8 hex digits, as a MongoDB ObjectId or a UUIDv7 begins), 16 random hex digits."""
    return f"batch_{int(time.time()):08x}{secrets.token_hex(8)}"


def valid_file_id(value: str) -> bool:
    return bool(FILE_ID.match(value))


def valid_batch_id(value: str) -> bool:
    return bool(BATCH_ID.match(value))


def derived_file_id(batch_id: str, kind: Literal["output", "error"]) -> str:
    """The id of a job's output or error file: fixed by the batch id, so a finalize that runs twice (a
    worker killed in the middle, or a paused one) writes the same file, never a second one."""
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]

"""`llm.requests`: what clients send. Keyed by request id."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

ID_PATTERN = r"^[A-Za-z0-9._:-]+\Z"  # no "/": ingest namespaces ids as "<tenant>/<id>" (topics.hops)
# Every string a refusal copies is bounded: a refusal before authentication carries the model, and a request
# just under the broker's record limit with a 1 MB model made a refusal over it, which was retried for ever.
MAX_MODEL_CHARS = 256
MAX_TENANT_CHARS = 128  # as topics.control.CANCEL_ID allows


class Priority(enum.StrEnum):
    interactive = "interactive"
    batch = "batch"


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 128
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


class PrincipalToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request carries in place of the caller's credential (pipeline/gateway/principal.py): who the
    caller is, signed over the whole request (by the bridge with the gateway secret, or by a direct
    producer with its key's own pair), valid until its deadline."""

    kind: Literal["key", "jwt", "signed_key"]  # signed_key: a direct producer signed with its key's own pair
    subject: Annotated[str, msgspec.Meta(max_length=256)]  # key, signed_key: the key's SHA-256 (never the key); jwt: `sub`
    expires_at: float  # unix seconds: the request's deadline (or the JWT's expiry, if sooner)
    # over the request with this blank: HMAC-SHA256 (hex) with the gateway secret; signed_key: Ed25519 (hex)
    mac: Annotated[str, msgspec.Meta(max_length=128)] = ""
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_CHARS)] | None = None  # jwt: the verified tenant claim; key: None
    models: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_MODEL_CHARS)], ...], msgspec.Meta(max_length=256)] = ()  # jwt: the verified models claim


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="request.v2", tag_field="kind"):
    """One LLM call. Exactly one of `messages` (chat) and `prompt` (completion) is set."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=ID_PATTERN)]  # the client's id
    reply_to: Annotated[str, msgspec.Meta(max_length=249)]  # a reply topic the operator configured (Kafka's longest name)
    model: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_CHARS)]
    created_at: float  # unix seconds, set by the client
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    sampling: Sampling = Sampling()
    stream: bool = True
    priority: Priority = Priority.interactive  # the engine's scheduling lane
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # seconds after created_at
    task: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_-]{0,31}\Z")] | None = None  # e.g. code, summarization: routing rules match it
    no_cache: bool = False  # never answered from the cache (HTTP `Cache-Control: no-cache`)
    no_store: bool = False  # the answer is not stored in the cache (`Cache-Control: no-store`)
    api_key: Annotated[str, msgspec.Meta(max_length=8192)] | None = None  # a direct producer's key or JWT, checked by ingest; never logged
    principal_token: PrincipalToken | None = None  # a signed principal, in place of `api_key`
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_CHARS)] = "default"  # a claim only: ingest replaces it with the authenticated principal's
    # Set by the bridge (never by the client): the caller's address and user agent, and an HMAC over
    # them with the gateway's client_info_secret, so ingest can tell them from a Kafka producer's claim.
    client_ip: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    user_agent: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    client_attestation: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    key_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None  # set by ingest: the public id of the API key it authenticated

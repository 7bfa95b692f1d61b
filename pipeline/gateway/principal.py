"""Principal tokens: what a request from the bridge carries to Kafka instead of the caller's credential.

    sign(secret, request, kind, subject, expires_at, ...)   the bridge: the request without `api_key`,
                                                             with a signed `principal_token`
    verify(secret, request)                                 ingest: the token if its signature holds, else None
                                                             (ingest then checks `expires_at`)
    sign_with_key(raw_key, request)                         a direct Kafka producer (the SDK): the request
                                                             without `api_key`, signed with the key's own pair
    verify_signature(verify_key, request)                   ingest: whether that signature holds

`llm.requests` keeps its records for a day, in the broker's segment files; a raw key there is a
credential that works until it is revoked. So the bridge sends, for an API key, only the key's SHA-256
(the hash the key store is indexed by, from which the key cannot be recovered) and, for a JWT, the claims
it verified itself. Ingest accepts a hash or claims only under the bridge's signature: HMAC-SHA256 with
the gateway secret (`gateway.client_info_secret`, SLUICE_GATEWAY_SECRET) over the whole request as
encoded with the token's `mac` blank, so it holds for exactly this request (id, content, reply topic,
client information) and only until `expires_at` (the request's deadline). Read off the topic, a token
can do nothing a redelivery of the same bytes could not: ingest treats those as the same request.
Ingest still looks the hash up, so a key revoked after the bridge signed is refused.

A direct producer has no gateway secret, so the SDK signs with the key itself: an Ed25519 pair derived
from the key (keys.signing_key), whose public half the key store keeps beside the hash. The token
(`kind = "signed_key"`) carries the hash and a signature over the whole request, valid until its
deadline. What Kafka and Redis hold (a hash, a public key, signatures over other requests) signs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pipeline.gateway.keys import hash_key, signing_key
from topics import codec
from topics.requests import PrincipalToken, Request

DOMAIN = b"sluice-principal-v1\n"  # so no other HMAC under the same secret is ever a valid token
SIGNED_DOMAIN = b"sluice-signed-request-v1\n"  # nor anything else the key's pair might sign


def sign_with_key(raw_key: str, request: Request) -> Request:
    """`request` without `api_key`, with a token naming the key's hash and signed by the key's own pair,
    valid until the request's deadline."""
    expires_at = request.created_at + request.deadline_s
    unsigned = PrincipalToken(kind="signed_key", subject=hash_key(raw_key), expires_at=expires_at)
    request = msgspec.structs.replace(request, api_key=None, principal_token=unsigned)
    signature = signing_key(raw_key).sign(SIGNED_DOMAIN + _blank(request))
    return msgspec.structs.replace(request, principal_token=msgspec.structs.replace(unsigned, mac=signature.hex()))


def verify_signature(verify_key: str, request: Request) -> bool:
    """Whether the request's `signed_key` token was signed by the pair whose public half is `verify_key`."""
    token = request.principal_token
    if token is None or token.kind != "signed_key":
        return False
    try:
        public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(verify_key))
        public.verify(bytes.fromhex(token.mac), SIGNED_DOMAIN + _blank(request))
    except (ValueError, InvalidSignature):
        return False
    return True


def sign(
    secret: str, request: Request, kind: Literal["key", "jwt"], subject: str, expires_at: float, *,
    tenant: str | None = None, models: tuple[str, ...] = (),
) -> Request:
    """`request` without a raw credential, with a principal token signed by `secret` (which must be set)."""
    if not secret:
        raise ValueError("a principal token needs the gateway secret")
    unsigned = PrincipalToken(kind=kind, subject=subject, expires_at=expires_at, tenant=tenant, models=models)
    request = msgspec.structs.replace(request, api_key=None, principal_token=unsigned)
    return msgspec.structs.replace(request, principal_token=msgspec.structs.replace(unsigned, mac=_mac(secret, request)))


def verify(secret: str, request: Request) -> PrincipalToken | None:
    """The request's token if `secret` signed it for this very request (the caller checks its expiry)."""
    token = request.principal_token
    if not secret or token is None or token.kind == "signed_key":
        return None
    return token if hmac.compare_digest(_mac(secret, request), token.mac) else None


def _mac(secret: str, request: Request) -> str:
    return hmac.new(secret.encode(), DOMAIN + _blank(request), hashlib.sha256).hexdigest()


def _blank(request: Request) -> bytes:
    """The request as signed: encoded with its token's `mac` empty."""
    token = request.principal_token
    assert token is not None
    return codec.encode(msgspec.structs.replace(request, principal_token=msgspec.structs.replace(token, mac="")))

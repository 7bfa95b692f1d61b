"""Principal tokens: what a request from the bridge carries to Kafka instead of the caller's credential.

    sign(secret, request, kind, subject, expires_at, ...)   the bridge: the request without `api_key`,
                                                             with a signed `principal_token`
    verify(secret, request)                                 ingest: the token if its signature holds, else None
                                                             (ingest then checks `expires_at`)

`llm.requests` keeps its records for a day, in the broker's segment files; a raw key there is a
credential that works until it is revoked. So the bridge sends, for an API key, only the key's SHA-256
(the hash the key store is indexed by, from which the key cannot be recovered) and, for a JWT, the claims
it verified itself. Ingest accepts a hash or claims only under the bridge's signature: HMAC-SHA256 with
the gateway secret (`gateway.client_info_secret`, SLUICE_GATEWAY_SECRET) over the whole request as
encoded with the token's `mac` blank, so it holds for exactly this request (id, content, reply topic,
client information) and only until `expires_at` (the request's deadline). Read off the topic, a token
can do nothing a redelivery of the same bytes could not: ingest treats those as the same request.
Ingest still looks the hash up, so a key revoked after the bridge signed is refused.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

import msgspec

from topics import codec
from topics.requests import PrincipalToken, Request

DOMAIN = b"sluice-principal-v1\n"  # so no other HMAC under the same secret is ever a valid token


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
    if not secret or token is None:
        return None
    return token if hmac.compare_digest(_mac(secret, request), token.mac) else None


def _mac(secret: str, request: Request) -> str:
    token = request.principal_token
    assert token is not None
    blank = msgspec.structs.replace(request, principal_token=msgspec.structs.replace(token, mac=""))
    return hmac.new(secret.encode(), DOMAIN + codec.encode(blank), hashlib.sha256).hexdigest()

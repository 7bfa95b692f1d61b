"""What the bridge sends to Kafka in place of the caller's credential.

    Credentials(settings).resolve(bearer)  the caller's credential, checked as far as the bridge can
                                           (async: a JWT is verified here); raises Unauthorized
    credential.apply(request)              the request as it goes to Kafka

With the gateway secret set (SLUICE_GATEWAY_SECRET, as in the secure profile), no raw credential leaves
the bridge: a `sk-sluice-` key becomes its SHA-256 and a JWT its verified claims, in a principal token
signed for that one request (pipeline/gateway/principal.py), which ingest verifies and, for a key, looks
up in the key store. Without the secret (the embedded demo) a key is signed with its own derived pair,
as the SDK signs (principal.sign_with_key), and a JWT is forwarded for ingest to check.

Anything else (`unused`, or an OpenAI key the `openai` client picked up from its environment) is never
forwarded: it is refused where auth is required and dropped (anonymous) where it is not, which is what
ingest would decide. A sluice key that is not well-formed is refused here with ingest's message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import msgspec

from pipeline.bridge.openai_format import BridgeError, Unauthorized
from pipeline.gateway.config import GatewaySettings
from pipeline.gateway.gateway import INVALID_KEY
from pipeline.gateway.jwt_auth import InvalidToken, JwtVerifier, KeysUnavailable, looks_like_jwt
from pipeline.gateway.keys import PREFIX, hash_key, well_formed
from pipeline.gateway.principal import sign, sign_with_key
from pipeline.settings import REPO_ROOT
from topics.errors import ErrorCode
from topics.requests import Request


class KeysAway(BridgeError):
    """503: the credential cannot be checked now: the identity provider's key set did not answer and the
    token's key is not cached, or the key store (Redis) did not answer a key's lookup; a retry after
    `Retry-After` may pass (a bad credential is a 401, never this)."""

    status = 503
    code = ErrorCode.unavailable

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.headers = {"retry-after": str(max(1, math.ceil(retry_after_s)))}


@dataclass(frozen=True)
class Credential:
    """One caller's credential as the bridge passes it on. `kind` None: no credential (anonymous)."""

    secret: str
    kind: Literal["key", "jwt"] | None = None
    raw: str | None = None  # a JWT is forwarded only when there is no secret to sign with
    subject: str = ""  # key: its SHA-256; jwt: `sub`
    tenant: str | None = None
    models: tuple[str, ...] = ()
    expires_at: float = math.inf  # a JWT's `exp`

    def apply(self, request: Request) -> Request:
        if self.kind is None:
            return msgspec.structs.replace(request, api_key=None)
        if not self.secret and self.kind == "key" and self.raw is not None:
            return sign_with_key(self.raw, request)  # as the SDK does: the key's own pair signs
        if not self.secret:
            return msgspec.structs.replace(request, api_key=self.raw)
        expires_at = min(request.created_at + request.deadline_s, self.expires_at)
        return sign(self.secret, request, self.kind, self.subject, expires_at, tenant=self.tenant, models=self.models)


class Credentials:
    def __init__(self, settings: GatewaySettings) -> None:
        self._secret = settings.client_info_secret
        self._auth_required = settings.auth_required
        self._jwt = JwtVerifier(settings.jwt, REPO_ROOT) if settings.jwt.enabled else None

    async def resolve(self, bearer: str | None) -> Credential:
        if bearer is not None and bearer.startswith(PREFIX):
            if not well_formed(bearer):
                raise Unauthorized(INVALID_KEY)
            return Credential(self._secret, "key", bearer, hash_key(bearer))
        if bearer is not None and self._jwt is not None and looks_like_jwt(bearer):
            try:
                claims = await self._jwt.verify(bearer)
            except KeysUnavailable as exc:
                raise KeysAway(str(exc), exc.retry_after_s) from None
            except InvalidToken as exc:
                raise Unauthorized(str(exc)) from None
            return Credential(self._secret, "jwt", bearer, claims.subject, claims.tenant, claims.models, claims.expires_at)
        if self._auth_required:
            raise Unauthorized(INVALID_KEY if bearer else "an API key is required (Authorization: Bearer sk-sluice-...)")
        return Credential(self._secret)

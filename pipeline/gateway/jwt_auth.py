"""JWT bearer tokens, verified with PyJWT against a JWKS.

The accepted algorithms are pinned by the config (so `alg: none` and an HS256 token "signed" with the
RSA public key are refused before any key is used); `iss`, `aud`, `exp` and `sub` are required and
checked, `nbf` is checked when present. The signing key is chosen by the token's `kid` from a JWKS file
read at start-up or from the operator's JWKS URL (fetched by PyJWT, cached, off the event loop).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import jwt

from pipeline.gateway.config import JwtSettings
from pipeline.gateway.keys import tenant_name

MAX_TOKEN_CHARS = 8192


class InvalidToken(Exception):
    """The token is not one this gateway accepts; the message is safe to show and names no claim value."""


@dataclass(frozen=True)
class TokenClaims:
    subject: str
    tenant: str
    models: tuple[str, ...]  # empty: no restriction from the token
    # `exp` plus the leeway, unix seconds: until when this verifier accepts the token, so ingest, given the
    # claims under the bridge's signature (bridge/credentials.py, capped at the deadline), refuses no
    # token the bridge accepted within its leeway
    expires_at: float = 0.0


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and len(token) <= MAX_TOKEN_CHARS


class JwtVerifier:
    def __init__(self, settings: JwtSettings, root: Path) -> None:
        self._settings = settings
        self._algorithms = list(settings.algorithms)
        self._keys: jwt.PyJWKSet | None = None
        self._client: jwt.PyJWKClient | None = None
        if settings.jwks_file:
            path = Path(settings.jwks_file)
            self._keys = jwt.PyJWKSet.from_dict(json.loads((path if path.is_absolute() else root / path).read_text()))
        elif settings.jwks_url:
            self._client = jwt.PyJWKClient(settings.jwks_url, cache_keys=True, lifespan=300, timeout=5)

    async def verify(self, token: str) -> TokenClaims:
        try:
            header = jwt.get_unverified_header(token)
            if header.get("alg") not in self._algorithms:
                raise InvalidToken("the token's algorithm is not accepted")
            key = await self._signing_key(token, header.get("kid"))
            claims = jwt.decode(
                token, key, algorithms=self._algorithms, audience=self._settings.audience,
                issuer=self._settings.issuer, leeway=self._settings.leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"], "verify_nbf": True},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise InvalidToken("the token is not valid yet") from None
        except (jwt.PyJWTError, jwt.PyJWKClientError, KeyError, ValueError, TypeError):  # TypeError: an HS token naming an RSA key
            raise InvalidToken("the token is not valid") from None
        tenant = claims.get(self._settings.tenant_claim)
        models = claims.get(self._settings.models_claim, [])
        if not tenant_name(tenant) or not isinstance(models, list):  # the rule a key's tenant keeps
            raise InvalidToken(f"the token lacks a valid `{self._settings.tenant_claim}` claim")
        expires_at = float(claims["exp"]) + self._settings.leeway_s
        return TokenClaims(str(claims["sub"]), tenant, tuple(str(m) for m in models), expires_at)

    async def _signing_key(self, token: str, kid: object) -> object:
        if self._keys is not None:
            if not isinstance(kid, str):
                raise InvalidToken("the token names no key (`kid`)")
            return self._keys[kid].key
        assert self._client is not None
        signing = await asyncio.to_thread(self._client.get_signing_key_from_jwt, token)
        return signing.key

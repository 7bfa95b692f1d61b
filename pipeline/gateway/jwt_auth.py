"""JWT bearer tokens, verified with PyJWT against a JWKS.

The accepted algorithms are pinned by the config (so `alg: none` and an HS256 token "signed" with the
RSA public key are refused before any key is used); `iss`, `aud`, `exp` and `sub` are required and
checked, `nbf` is checked when present. The signing key is chosen by the token's `kid` from a JWKS file
read at start-up or from the operator's JWKS URL (`RemoteKeys`: fetched by PyJWT on a thread of its own).

    InvalidToken        the token is refused (401)
    └── KeysUnavailable the JWKS URL did not answer and the token's key is not cached: not the token's
                        fault (`code`: unavailable, 503, retriable); a caller that knows only
                        InvalidToken still refuses it
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jwt

from pipeline.gateway.config import JwtSettings
from pipeline.gateway.keys import tenant_name
from topics.errors import ErrorCode

log = logging.getLogger(__name__)

MAX_TOKEN_CHARS = 8192
FETCH_TIMEOUT_S = 5.0  # one JWKS fetch (PyJWT's socket timeout), and the longest a verification waits for one
RETRY_AFTER_S = 10.0  # after a fetch failed, a token whose key is not cached is refused at once for this long
REFRESH_S = 300.0  # a key set this old is fetched again (in the background: its keys serve meanwhile)
UNKNOWN_KID_COOLDOWN_S = 30.0  # an unknown `kid` fetches the set at most this often (PyJWT's cooldown)


class InvalidToken(Exception):
    """The token is not one this gateway accepts; the message is safe to show and names no claim value."""

    code: ClassVar[ErrorCode] = ErrorCode.unauthorized


class KeysUnavailable(InvalidToken):
    """The JWKS URL did not answer (or not in time) and the token's `kid` is not among the keys fetched
    before: worth a retry after `retry_after_s`."""

    code: ClassVar[ErrorCode] = ErrorCode.unavailable

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
        self._remote: RemoteKeys | None = None
        if settings.jwks_file:
            path = Path(settings.jwks_file)
            self._keys = jwt.PyJWKSet.from_dict(json.loads((path if path.is_absolute() else root / path).read_text()))
        elif settings.jwks_url:
            self._remote = RemoteKeys(settings.jwks_url)

    async def aclose(self) -> None:
        """Stops the JWKS fetch thread, if there is one (a fetch under way ends with its timeout)."""
        if self._remote is not None:
            self._remote.close()

    async def verify(self, token: str) -> TokenClaims:
        try:
            header = jwt.get_unverified_header(token)
            if header.get("alg") not in self._algorithms:
                raise InvalidToken("the token's algorithm is not accepted")
            key = await self._signing_key(header.get("kid"))
            claims = jwt.decode(
                token, key, algorithms=self._algorithms, audience=self._settings.audience,
                issuer=self._settings.issuer, leeway=self._settings.leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"], "verify_nbf": True},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise InvalidToken("the token is not valid yet") from None
        except (jwt.PyJWTError, KeyError, ValueError, TypeError):  # TypeError: an HS token naming an RSA key
            raise InvalidToken("the token is not valid") from None
        tenant = claims.get(self._settings.tenant_claim)
        models = claims.get(self._settings.models_claim, [])
        if not tenant_name(tenant) or not isinstance(models, list):  # the rule a key's tenant keeps
            raise InvalidToken(f"the token lacks a valid `{self._settings.tenant_claim}` claim")
        expires_at = float(claims["exp"]) + self._settings.leeway_s
        return TokenClaims(str(claims["sub"]), tenant, tuple(str(m) for m in models), expires_at)

    async def _signing_key(self, kid: object) -> object:
        if not isinstance(kid, str):
            raise InvalidToken("the token names no key (`kid`)")
        if self._keys is not None:
            return self._keys[kid].key
        assert self._remote is not None
        return (await self._remote.key(kid)).key


class RemoteKeys:
    """The signing keys at the operator's JWKS URL, by `kid`.

    Not PyJWKClient's own caching, called through `asyncio.to_thread`: it fetches with blocking urllib
    under a lock and only a successful fetch starts its cooldown, so with the IdP hung each verification
    held a thread of the loop's default pool for the whole timeout, in turn, and that pool also runs the
    guard's batcher, the cache's embedding and the KV store (8 verifications kept an unrelated
    `to_thread` waiting 15 s). Here PyJWT only fetches and parses, and:

    - a key fetched before serves from memory, without a thread, whether the IdP answers or not; the set
      is fetched again in the background once REFRESH_S old, and replaced whole, so a key the IdP drops
      stops verifying then;
    - a fetch runs on this object's one thread, never the default pool, one at a time: the verifications
      that need keys await the same fetch, each for FETCH_TIMEOUT_S at most;
    - after a fetch failed or was not waited for to its end, a token whose key is not cached is refused
      at once (KeysUnavailable) for RETRY_AFTER_S: a hung IdP costs one thread and a wait per
      RETRY_AFTER_S, not the pool and a wait per request;
    - an unknown `kid` fetches the set at most once per UNKNOWN_KID_COOLDOWN_S (otherwise made-up `kid`s
      would fetch it on every request).
    """

    def __init__(self, url: str) -> None:
        self._timeout_s = FETCH_TIMEOUT_S
        self._client = jwt.PyJWKClient(url, cache_jwk_set=False, timeout=self._timeout_s)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jwks")
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at = -math.inf  # time.monotonic() of the last fetch that succeeded
        self._failed_until = -math.inf  # no fetch is tried before then
        self._fetch: asyncio.Future[dict[str, jwt.PyJWK]] | None = None  # the one under way

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def key(self, kid: str) -> jwt.PyJWK:
        now = time.monotonic()
        age = now - self._fetched_at
        if (key := self._keys.get(kid)) is not None:
            if age >= REFRESH_S and self._fetch is None and now >= self._failed_until:
                self._start_fetch()  # not awaited: this key serves meanwhile, and on if the IdP is away
            return key
        if age < UNKNOWN_KID_COOLDOWN_S:  # maybe a key the IdP has just added: a retry after the cooldown
            raise KeysUnavailable("the token's key (`kid`) is not among the keys fetched; they are fetched "
                                  "again shortly", UNKNOWN_KID_COOLDOWN_S - age)  # fetches it (a 401 then, if absent)
        if now < self._failed_until:
            raise KeysUnavailable("the token's keys could not be fetched", self._failed_until - now)
        fetch = self._fetch or self._start_fetch()
        try:
            async with asyncio.timeout(self._timeout_s):
                keys = await asyncio.shield(fetch)  # a waiter's timeout leaves the fetch to the others
        except TimeoutError:
            self._failed_until = max(self._failed_until, time.monotonic() + RETRY_AFTER_S)
            raise KeysUnavailable("the token's keys could not be fetched in time", RETRY_AFTER_S) from None
        except Exception:  # whatever the IdP's answer made PyJWT raise: `_fetched` logged it
            raise KeysUnavailable("the token's keys could not be fetched", RETRY_AFTER_S) from None
        if (key := keys.get(kid)) is None:
            raise InvalidToken("the token's key (`kid`) is not in the JWKS")
        return key

    def _start_fetch(self) -> asyncio.Future[dict[str, jwt.PyJWK]]:
        self._fetch = asyncio.get_running_loop().run_in_executor(self._executor, self._fetch_keys)
        self._fetch.add_done_callback(self._fetched)
        return self._fetch

    def _fetch_keys(self) -> dict[str, jwt.PyJWK]:  # on the fetch thread
        return {key.key_id: key for key in self._client.get_signing_keys(refresh=True) if key.key_id}

    def _fetched(self, fetch: asyncio.Future[dict[str, jwt.PyJWK]]) -> None:
        self._fetch = None
        if fetch.cancelled():  # closed
            return
        if (error := fetch.exception()) is not None:
            self._failed_until = time.monotonic() + RETRY_AFTER_S
            log.warning("the JWKS could not be fetched (%s: %s); tokens whose key is not cached are refused "
                        "as unavailable for %g s", type(error).__name__, error, RETRY_AFTER_S)
            return
        self._keys = fetch.result()
        self._fetched_at = time.monotonic()
        self._failed_until = -math.inf

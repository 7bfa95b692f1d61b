"""JWT: pinned algorithms, iss/aud/exp/nbf, and the two classic forgeries."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from pipeline.errors import StageError
from pipeline.gateway.config import GatewaySettings, JwtSettings
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.jwt_auth import JwtVerifier
from pipeline.gateway.keys import MemoryKeyStore
from pipeline.gateway.limits import MemoryLimiter
from tests.unit.helpers import request
from topics.errors import ErrorCode

pytestmark = pytest.mark.asyncio
ISS, AUD = "https://idp.example", "sluice"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def gateway(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> Gateway:
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    settings = JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_file=str(tmp_path / "jwks.json"))
    gw = GatewaySettings(auth_required=True, jwt=settings)
    return Gateway(gw, MemoryKeyStore(), MemoryLimiter(60.0), JwtVerifier(settings, tmp_path))


def token(key: rsa.RSAPrivateKey, **claims: object) -> str:
    now = int(time.time())
    body = {"iss": ISS, "aud": AUD, "sub": "svc-1", "tenant": "acme", "exp": now + 60, "iat": now, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm="RS256", headers={"kid": "k1"})


async def code_for(gateway: Gateway, credential: str) -> ErrorCode | None:
    try:
        await gateway.admit(request(api_key=credential))
    except StageError as exc:
        return exc.code
    return None


async def test_a_valid_token_is_admitted_under_its_tenant(gateway: Gateway, rsa_key: rsa.RSAPrivateKey) -> None:
    forwarded, principal = await gateway.admit(request(api_key=token(rsa_key)))
    assert forwarded.tenant == "acme" and principal.name == "jwt:svc-1" and forwarded.api_key is None


@pytest.mark.parametrize(
    "claims",
    [{"exp": int(time.time()) - 5}, {"nbf": int(time.time()) + 86400}, {"aud": "other"}, {"iss": "https://evil"},
     {"exp": None}, {"tenant": None}, {"models": ["not-this-one"]}],
)
async def test_bad_claims_are_refused(gateway: Gateway, rsa_key: rsa.RSAPrivateKey, claims: dict[str, object]) -> None:
    assert await code_for(gateway, token(rsa_key, **claims)) in {ErrorCode.unauthorized, ErrorCode.forbidden}


async def test_alg_none_is_refused(gateway: Gateway) -> None:
    header = b64(json.dumps({"alg": "none", "typ": "JWT", "kid": "k1"}).encode())
    claims = b64(json.dumps({"iss": ISS, "aud": AUD, "sub": "x", "tenant": "acme", "exp": int(time.time()) + 60}).encode())
    assert await code_for(gateway, f"{header}.{claims}.") is ErrorCode.unauthorized


async def test_hs256_signed_with_the_rsa_public_key_is_refused(gateway: Gateway, rsa_key: rsa.RSAPrivateKey) -> None:
    public_pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    claims = b64(json.dumps({"iss": ISS, "aud": AUD, "sub": "x", "tenant": "acme", "exp": int(time.time()) + 60}).encode())
    signature = b64(hmac.new(public_pem, f"{header}.{claims}".encode(), hashlib.sha256).digest())
    assert await code_for(gateway, f"{header}.{claims}.{signature}") is ErrorCode.unauthorized


async def test_a_token_signed_by_another_key_is_refused(gateway: Gateway) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert await code_for(gateway, token(other)) is ErrorCode.unauthorized

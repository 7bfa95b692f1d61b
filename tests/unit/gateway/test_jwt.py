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
from pipeline.gateway.config import GatewaySettings, JwtSettings, ModelPrice, TenantPolicy
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.jwt_auth import InvalidToken, JwtVerifier
from pipeline.gateway.keys import MemoryKeyStore
from pipeline.gateway.limits import MemoryLimiter, Scope
from tests.unit.helpers import MODEL, request
from topics.errors import ErrorCode
from topics.stream import Done, FinishReason, Usage

pytestmark = pytest.mark.asyncio
ISS, AUD = "https://idp.example", "sluice"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def gateway(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> Gateway:
    return jwt_gateway(rsa_key, tmp_path, MemoryLimiter(60.0))


def jwt_gateway(rsa_key: rsa.RSAPrivateKey, tmp_path: Path, limiter: MemoryLimiter, **gateway: object) -> Gateway:
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    settings = JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_file=str(tmp_path / "jwks.json"))
    gw = GatewaySettings(auth_required=True, jwt=settings, **gateway)  # type: ignore[arg-type]
    return Gateway(gw, MemoryKeyStore(), limiter, JwtVerifier(settings, tmp_path))


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


async def test_a_tenant_claim_must_be_a_tenant_name(gateway: Gateway, rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    """As a key's tenant must be (keys.tenant_name): "a/b" made request ids `a/b/<id>` that no cancel's
    CANCEL_ID matches, and a tenant past the schema's 128 characters dead-lettered the request."""
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(
        rsa_key.public_key())), "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    verifier = JwtVerifier(JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_file="jwks.json"), tmp_path)
    for tenant in ("a/b", "x" * 200, "a b", "tab\there", "", 7):
        with pytest.raises(InvalidToken):
            await verifier.verify(token(rsa_key, tenant=tenant))
        assert await code_for(gateway, token(rsa_key, tenant=tenant)) is ErrorCode.unauthorized
    assert (await verifier.verify(token(rsa_key, tenant="x" * 128))).tenant == "x" * 128


@pytest.mark.parametrize("leeway_s", [float("nan"), float("inf"), -1.0, 301.0])
async def test_a_leeway_that_is_not_a_bounded_number_is_refused(leeway_s: float) -> None:
    """NaN or inf (valid TOML) turned PyJWT's `exp` and `nbf` checks off."""
    assert any("leeway_s" in p for p in GatewaySettings(jwt=JwtSettings(leeway_s=leeway_s)).problems())


async def test_a_leeway_up_to_five_minutes_is_taken() -> None:
    for leeway_s in (0.0, 30.0, 300.0):
        assert GatewaySettings(jwt=JwtSettings(leeway_s=leeway_s)).problems() == []


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


async def test_a_subject_keeps_no_running_spend(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    """Its scope `jwt:<sub>` can have no budget, yet each subject ever seen kept a spend with no TTL in
    Redis (a key volatile-lru never evicts); its tenant, without a budget, one more. llm.usage has the charge."""
    limiter = MemoryLimiter(60.0)
    gateway = jwt_gateway(rsa_key, tmp_path, limiter, prices={MODEL: ModelPrice(prompt_per_1k=1.0, completion_per_1k=2.0)},
                          tenants={"capped": TenantPolicy(budget=10.0)})
    for rid, tenant in (("a", "acme"), ("b", "capped")):
        await gateway.admit(request(rid, api_key=token(rsa_key, sub=f"svc-{rid}", tenant=tenant)))
        await gateway.finish(Done(id=f"{tenant}/{rid}", reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop,
                                  usage=Usage(prompt_tokens=100, completion_tokens=200), tenant=tenant, model=MODEL, created_at=1.0))
    assert await limiter.spent(Scope("key", "jwt:svc-a")) == 0.0 and await limiter.spent(Scope("key", "jwt:svc-b")) == 0.0
    assert await limiter.spent(Scope("tenant", "acme")) == 0.0
    assert await limiter.spent(Scope("tenant", "capped")) == pytest.approx(0.5)  # a budget still counts it

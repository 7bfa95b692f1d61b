"""JWT: pinned algorithms, iss/aud/exp/nbf, and the two classic forgeries."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from pipeline.errors import StageError
from pipeline.gateway import jwt_auth
from pipeline.gateway.config import GatewaySettings, JwtSettings, ModelPrice, TenantPolicy
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.jwt_auth import InvalidToken, JwtVerifier, KeysUnavailable
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


@pytest.mark.parametrize("url", [
    "http://idp.example.com/jwks", "http://10.0.0.7/jwks", "http://localhost.example.com/jwks",
    "http://127.0.0.1@idp.example.com/jwks", "file:///etc/jwks.json", "data:application/json,{}", "ftp://idp/jwks",
    "https:///jwks", "idp.example.com/jwks",
])
async def test_a_jwks_url_anyone_on_the_path_could_answer_is_refused(url: str) -> None:
    """PyJWT's urllib opener fetches http://, file:// and data: alike; over plain http whoever is on the
    path serves the keys, and so signs any token."""
    problems = GatewaySettings(jwt=JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_url=url)).problems()
    assert [p for p in problems if p.startswith("gateway.jwt.jwks_url: must be an https:// URL")], problems


@pytest.mark.parametrize("url", [
    "https://idp.example.com/.well-known/jwks.json", "HTTPS://IDP.example.com/jwks", "http://127.0.0.1:8081/jwks",
    "http://localhost/jwks", "http://[::1]:9000/jwks",
])
async def test_an_https_jwks_url_or_plain_http_to_loopback_is_taken(url: str) -> None:
    assert GatewaySettings(jwt=JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_url=url)).problems() == []


async def test_a_leftover_jwks_url_is_not_checked_while_jwt_is_off() -> None:
    """Nothing fetches it then: a config with JWT off and an old http:// URL still loads."""
    assert GatewaySettings(jwt=JwtSettings(enabled=False, jwks_url="http://idp.internal/jwks")).problems() == []


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


class Idp:
    """A JWKS URL on a local socket: it answers with `jwks`, or, with `hang` set, accepts and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)  # accept() wakes to see `stopped`
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/jwks"
        self.jwks: dict[str, object] = {"keys": []}
        self.hang = False
        self.connections = 0
        self.held: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.hang:
                self.held.append(conn)
                continue
            with conn:
                conn.settimeout(5.0)
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                    head += chunk
                body = json.dumps(self.jwks).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.listener.close()
        for conn in self.held:  # a fetch still reading fails now
            conn.close()


@pytest.fixture
def idp() -> Iterator[Idp]:
    server = Idp()
    yield server
    server.close()


def jwks(key: rsa.RSAPrivateKey, kid: str = "k1") -> dict[str, object]:
    return {"keys": [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": kid, "use": "sig", "alg": "RS256"}]}


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def url_verifier(url: str) -> JwtVerifier:
    return JwtVerifier(JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_url=url), Path("."))


@pytest.mark.asyncio(loop_scope="function")  # a loop of its own, whose default pool it sets
async def test_a_hung_jwks_url_holds_one_thread_of_its_own_not_the_default_pool(
    rsa_key: rsa.RSAPrivateKey, idp: Idp, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyJWKClient called through `to_thread` fetched under a lock, one verification after another, each
    on a thread of the default pool for its whole timeout: 8 of them against a URL that never answered
    kept an unrelated `to_thread` (the guard's batcher, the cache's embedding, a KV get) waiting 15 s."""
    monkeypatch.setattr(jwt_auth, "FETCH_TIMEOUT_S", 1.0, raising=False)
    monkeypatch.setattr(jwt_auth, "RETRY_AFTER_S", 30.0, raising=False)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(8))  # the default pool on 4 CPUs
    idp.hang = True
    verifier = url_verifier(idp.url)
    started = time.perf_counter()
    burst = [asyncio.create_task(verifier.verify(token(rsa_key))) for _ in range(8)]
    await asyncio.sleep(0.1)
    t = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.to_thread(lambda: None), 2.0)
    except TimeoutError:
        pass
    waited = time.perf_counter() - t
    assert waited < 0.2, f"an unrelated to_thread call waited {waited:.1f} s"
    results = await asyncio.gather(*burst, return_exceptions=True)
    took = time.perf_counter() - started
    assert all(isinstance(r, jwt_auth.KeysUnavailable) for r in results), results
    assert results[0].code is ErrorCode.unavailable and took < 1.0 + 0.5  # type: ignore[union-attr]
    assert idp.connections == 1  # one fetch for all 8

    t = time.perf_counter()  # within RETRY_AFTER_S: refused at once, and the URL is not tried again
    again = await asyncio.gather(*(verifier.verify(token(rsa_key)) for _ in range(8)), return_exceptions=True)
    assert all(isinstance(r, jwt_auth.KeysUnavailable) for r in again) and time.perf_counter() - t < 0.05
    assert idp.connections == 1
    await verifier.aclose()


async def test_keys_fetched_before_verify_while_the_jwks_url_hangs(
    rsa_key: rsa.RSAPrivateKey, idp: Idp, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jwt_auth, "FETCH_TIMEOUT_S", 0.5, raising=False)
    idp.jwks = jwks(rsa_key)
    verifier = url_verifier(idp.url)
    assert (await verifier.verify(token(rsa_key))).tenant == "acme" and idp.connections == 1
    # A `kid` the set lacks, just fetched: not fetched again within the cooldown, and refused as retriable
    # (503 after it), not 401: it may be a key the IdP has just added (a key rotation).
    with pytest.raises(jwt_auth.KeysUnavailable) as refused:
        await verifier.verify(jwt.encode({"sub": "x"}, rsa_key, algorithm="RS256", headers={"kid": "k9"}))
    assert 0 < refused.value.retry_after_s <= jwt_auth.UNKNOWN_KID_COOLDOWN_S and idp.connections == 1

    idp.hang = True
    monkeypatch.setattr(jwt_auth, "REFRESH_S", 0.0, raising=False)  # every key is due a refresh: fetched in the background
    for _ in range(5):
        t = time.perf_counter()
        assert (await verifier.verify(token(rsa_key))).tenant == "acme" and time.perf_counter() - t < 0.1
    await until(lambda: idp.connections >= 2)
    await asyncio.sleep(0.7)  # the refresh failed (FETCH_TIMEOUT_S): the key serves on
    assert idp.connections == 2  # one refresh for all five
    assert (await verifier.verify(token(rsa_key))).tenant == "acme"
    await verifier.aclose()


async def test_a_key_the_jwks_url_drops_stops_verifying_after_a_refresh(
    rsa_key: rsa.RSAPrivateKey, idp: Idp, monkeypatch: pytest.MonkeyPatch,
) -> None:
    idp.jwks = jwks(rsa_key)
    verifier = url_verifier(idp.url)
    assert (await verifier.verify(token(rsa_key))).tenant == "acme"
    idp.jwks = jwks(rsa.generate_private_key(public_exponent=65537, key_size=2048), "k2")  # k1 rotated out
    monkeypatch.setattr(jwt_auth, "REFRESH_S", 0.0, raising=False)
    await verifier.verify(token(rsa_key))  # served, and the refresh starts
    await until(lambda: idp.connections == 2)
    await asyncio.sleep(0.1)  # the answer is read
    with pytest.raises(InvalidToken):
        await verifier.verify(token(rsa_key))
    await verifier.aclose()


@pytest.mark.asyncio
async def test_an_idp_outage_is_a_retriable_503_at_ingest_and_at_the_bridge(
    gateway: Gateway, rsa_key: rsa.RSAPrivateKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys away (`KeysUnavailable`) is not a bad token: a 401 told the client to fix a credential
    that was fine, and gave it no reason to retry."""
    from pipeline.bridge.credentials import Credentials, KeysAway

    async def away(credential: str) -> object:
        raise KeysUnavailable("the identity provider's keys did not answer", 7.5)

    monkeypatch.setattr(JwtVerifier, "verify", lambda self, credential: away(credential))
    with pytest.raises(StageError) as refused:
        await gateway.admit(request(api_key=token(rsa_key)))
    assert (refused.value.code, refused.value.retry_after_s) == (ErrorCode.unavailable, 7.5)
    bridge = Credentials(GatewaySettings(auth_required=True, jwt=JwtSettings(enabled=True, issuer=ISS, audience=AUD)))
    bridge._jwt = gateway._jwt  # the same verifier, keys away
    with pytest.raises(KeysAway) as answered:
        await bridge.resolve(token(rsa_key))
    assert (answered.value.status, answered.value.headers["retry-after"]) == (503, "8")

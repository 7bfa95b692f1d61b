"""Principal tokens: the bridge's signed stand-in for a credential, and what ingest's gateway makes of it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jwt
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from pipeline.bridge.credentials import Credentials
from pipeline.bridge.openai_format import Unauthorized
from pipeline.errors import StageError
from pipeline.gateway.config import GatewaySettings, JwtSettings
from pipeline.gateway.gateway import SIGNED_LIFETIME_S, Gateway
from pipeline.gateway.jwt_auth import JwtVerifier
from pipeline.gateway.keys import PREFIX, KeyManager, MemoryKeyStore, hash_key, verify_key_of
from pipeline.gateway.limits import MemoryLimiter
from pipeline.gateway.principal import sign, sign_with_key
from pipeline.sdk import Client
from tests.unit.gateway.helpers import Rig, rig
from tests.unit.gateway.test_jwt import AUD, ISS, rsa_key, token
from tests.unit.helpers import SETTINGS, request
from topics import codec
from topics.errors import ErrorCode
from topics.requests import ChatMessage, Request

__all__ = ["rsa_key"]  # fixture
pytestmark = pytest.mark.asyncio
SECRET = "unit-gateway-secret"


def signed(r: Rig, raw_key: str, rid: str = "r1", secret: str = SECRET, **overrides: object) -> Request:
    """What the bridge sends for `raw_key`, through the wire (encoded and decoded) as ingest reads it."""
    req = request(rid, api_key=raw_key, created_at=r.clock.now, deadline_s=60.0, **overrides)
    token = sign(secret, req, "key", hash_key(raw_key), req.created_at + req.deadline_s)
    return codec.decode(codec.encode(token), Request)


async def code_of(r: Rig, req: Request) -> ErrorCode:
    with pytest.raises(StageError) as caught:
        await r.gateway.admit(req)
    return caught.value.code


async def test_a_signed_key_hash_is_admitted_and_the_raw_key_is_not_on_the_wire() -> None:
    r = rig(client_info_secret=SECRET)
    raw, record = await r.keys.create("acme")
    req = signed(r, raw)
    assert req.api_key is None and raw.encode() not in codec.encode(req) and raw[len(PREFIX) :].encode() not in codec.encode(req)
    forwarded, principal = await r.gateway.admit(req)
    assert principal.name == "key:" + record.key_id and forwarded.tenant == "acme"
    assert forwarded.principal_token is None and forwarded.api_key is None


async def test_a_token_for_one_request_does_not_authenticate_another() -> None:
    r = rig(client_info_secret=SECRET)
    raw, _ = await r.keys.create("acme")
    token = signed(r, raw).principal_token
    other = msgspec.structs.replace(signed(r, raw), messages=(ChatMessage(role="user", content="something else"),))
    assert await code_of(r, other) is ErrorCode.unauthorized  # same token, other content
    assert await code_of(r, msgspec.structs.replace(signed(r, raw, "r2"), principal_token=token)) is ErrorCode.unauthorized
    moved = msgspec.structs.replace(signed(r, raw), reply_to="llm.responses.elsewhere")
    assert await code_of(r, moved) is ErrorCode.unauthorized


async def test_a_hash_alone_or_under_another_secret_is_refused() -> None:
    r = rig(client_info_secret=SECRET)
    raw, _ = await r.keys.create("acme")
    forged = signed(r, raw, secret="not-the-gateway-secret")
    assert await code_of(r, forged) is ErrorCode.unauthorized
    token = signed(r, raw).principal_token
    assert token is not None
    unsigned = msgspec.structs.replace(signed(r, raw), principal_token=msgspec.structs.replace(token, mac=""))
    assert await code_of(r, unsigned) is ErrorCode.unauthorized
    both = msgspec.structs.replace(signed(r, raw), api_key=raw)  # a token and a key: neither is taken
    assert await code_of(r, both) is ErrorCode.unauthorized
    no_secret = rig()  # an ingest without the secret cannot check a token, so it accepts none
    raw2, _ = await no_secret.keys.create("acme")
    assert await code_of(no_secret, signed(no_secret, raw2)) is ErrorCode.unauthorized


async def test_an_expired_token_or_a_revoked_key_is_refused() -> None:
    r = rig(client_info_secret=SECRET)
    raw, record = await r.keys.create("acme")
    late = signed(r, raw)
    r.clock.now += 61
    assert await code_of(r, late) is ErrorCode.deadline_exceeded
    revoked = signed(r, raw, "r3")
    await r.keys.revoke(record.key_id)
    assert await code_of(r, revoked) is ErrorCode.unauthorized  # ingest looks the hash up: revocation bites


async def test_a_jwt_principal_is_taken_only_with_jwt_enabled() -> None:
    r = rig(client_info_secret=SECRET)  # JWT not enabled here
    req = request(created_at=r.clock.now, deadline_s=60.0)
    token = sign(SECRET, req, "jwt", "svc-1", r.clock.now + 30, tenant="acme", models=())
    assert await code_of(r, token) is ErrorCode.unauthorized


async def test_the_bridge_never_forwards_a_foreign_credential() -> None:
    req = request(created_at=1.0)
    open_bridge = Credentials(GatewaySettings(auth_required=False, client_info_secret=SECRET))
    for foreign in ("unused", "sk-proj-" + "x" * 40, None):
        assert (await open_bridge.resolve(foreign)).apply(req).api_key is None
    closed = Credentials(GatewaySettings(auth_required=True, client_info_secret=SECRET))
    for refused in ("unused", PREFIX + "' OR '1'='1", None):
        with pytest.raises(Unauthorized):
            await closed.resolve(refused)
    key = PREFIX + "A" * 43
    sent = (await closed.resolve(key)).apply(req)
    assert sent.api_key is None and sent.principal_token is not None and sent.principal_token.subject == hash_key(key)
    demo = Credentials(GatewaySettings(auth_required=False))  # no secret: signed with the key's own pair, as the SDK does
    sent = (await demo.resolve(key)).apply(req)
    assert sent.api_key is None and sent.principal_token is not None and sent.principal_token.kind == "signed_key"


async def test_the_bridge_verifies_a_jwt_and_sends_its_claims_signed(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    jwt_settings = JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_file=str(tmp_path / "jwks.json"))
    settings = GatewaySettings(auth_required=True, jwt=jwt_settings, client_info_secret=SECRET)
    raw = token(rsa_key, models=["m1"])
    sent = (await Credentials(settings).resolve(raw)).apply(request(deadline_s=600.0))
    wire = codec.encode(sent)
    assert raw.encode() not in wire and raw.split(".")[2].encode() not in wire  # neither the token nor its signature
    assert sent.principal_token is not None and sent.principal_token.expires_at <= time.time() + 61  # the JWT's exp
    gateway = Gateway(settings, MemoryKeyStore(), MemoryLimiter(60.0), JwtVerifier(jwt_settings, tmp_path))
    principal = await gateway.authenticate(codec.decode(wire, Request))
    assert principal.name == "jwt:svc-1" and principal.tenant == "acme" and principal.models == ("m1",)
    with pytest.raises(Unauthorized):
        await Credentials(settings).resolve(token(rsa_key, exp=int(time.time()) - 120))


async def test_ingest_takes_a_jwt_the_bridge_took_within_its_leeway(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    """The principal token carried `exp` without the leeway: a token the bridge accepted in its leeway
    reached ingest already expired (401). It carries `exp` plus the leeway, never past the deadline."""
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    jwt_settings = JwtSettings(enabled=True, issuer=ISS, audience=AUD, jwks_file=str(tmp_path / "jwks.json"), leeway_s=30.0)
    settings = GatewaySettings(auth_required=True, jwt=jwt_settings, client_info_secret=SECRET)
    exp = int(time.time()) - 10  # expired, within the leeway
    credential = await Credentials(settings).resolve(token(rsa_key, exp=exp))
    sent = credential.apply(request(created_at=time.time(), deadline_s=600.0))
    assert sent.principal_token is not None and sent.principal_token.expires_at == exp + 30.0
    gateway = Gateway(settings, MemoryKeyStore(), MemoryLimiter(60.0), JwtVerifier(jwt_settings, tmp_path))
    principal = await gateway.authenticate(codec.decode(codec.encode(sent), Request))
    assert principal.name == "jwt:svc-1" and principal.tenant == "acme"
    short = request(created_at=time.time(), deadline_s=5.0)
    sent = credential.apply(short)
    assert sent.principal_token is not None and sent.principal_token.expires_at == short.created_at + 5.0


def sdk_signed(r: Rig, raw_key: str, rid: str = "s1", **overrides: object) -> Request:
    """What the SDK sends for `raw_key` (at the rig's time), through the wire as ingest reads it."""
    req = request(rid, **{"created_at": r.clock.now, "deadline_s": 60.0, **overrides})
    return codec.decode(codec.encode(sign_with_key(raw_key, req)), Request)


async def test_the_sdk_signs_with_its_keys_own_pair_and_never_sends_the_key() -> None:
    r = rig()  # a direct producer's signature needs no gateway secret
    raw, record = await r.keys.create("acme")
    req = Client(SETTINGS).request(prompt="hi", api_key=raw)
    wire = codec.encode(req)
    assert req.api_key is None and raw[len(PREFIX) :].encode() not in wire
    token = req.principal_token
    assert token is not None and token.kind == "signed_key" and token.subject == hash_key(raw)
    assert token.expires_at == req.created_at + req.deadline_s
    assert record.verify_keys == {hash_key(raw): verify_key_of(raw)}  # the store keeps only the public half
    _, principal = await r.gateway.admit(sdk_signed(r, raw))
    assert principal.name == "key:" + record.key_id
    jwt_like = Client(SETTINGS).request(prompt="hi", api_key="a.b.c")  # not a sluice key: sent for ingest to check
    assert jwt_like.api_key == "a.b.c" and jwt_like.principal_token is None


async def test_an_sdk_signature_holds_for_its_own_request_and_key_only() -> None:
    r = rig(client_info_secret=SECRET)
    raw, _ = await r.keys.create("acme")
    other_raw, _ = await r.keys.create("acme")
    good = sdk_signed(r, raw)
    changed = msgspec.structs.replace(good, messages=(ChatMessage(role="user", content="something else"),))
    assert await code_of(r, changed) is ErrorCode.unauthorized
    assert await code_of(r, msgspec.structs.replace(good, reply_to="llm.responses.elsewhere")) is ErrorCode.unauthorized
    token = good.principal_token
    assert token is not None
    theirs = sdk_signed(r, other_raw).principal_token  # another key's valid signature, this key's hash
    assert theirs is not None
    assert await code_of(r, msgspec.structs.replace(good, principal_token=msgspec.structs.replace(token, mac=theirs.mac))) is ErrorCode.unauthorized
    assert await code_of(r, msgspec.structs.replace(good, principal_token=msgspec.structs.replace(token, mac=""))) is ErrorCode.unauthorized
    assert await code_of(r, msgspec.structs.replace(good, principal_token=msgspec.structs.replace(token, mac="zz" * 64))) is ErrorCode.unauthorized
    assert await code_of(r, msgspec.structs.replace(good, api_key=raw)) is ErrorCode.unauthorized
    # An HMAC under the gateway secret is not a signature of the key's pair, whatever its kind says.
    hmac_signed = sign(SECRET, request("h1", created_at=r.clock.now, deadline_s=60.0), "key", hash_key(raw), r.clock.now + 60)
    relabelled = msgspec.structs.replace(hmac_signed.principal_token, kind="signed_key")
    assert await code_of(r, msgspec.structs.replace(hmac_signed, principal_token=relabelled)) is ErrorCode.unauthorized
    await r.gateway.admit(good)


async def test_an_sdk_signature_is_refused_once_expired_too_long_lived_revoked_or_for_an_old_record() -> None:
    r = rig()
    raw, record = await r.keys.create("acme")
    late = sdk_signed(r, raw)
    r.clock.now += 61
    assert await code_of(r, late) is ErrorCode.deadline_exceeded
    assert await code_of(r, sdk_signed(r, raw, "s2", deadline_s=2 * SIGNED_LIFETIME_S)) is ErrorCode.invalid_request
    new, _ = await r.keys.rotate(record.key_id, overlap_s=10)
    await r.gateway.admit(sdk_signed(r, raw, "s3"))  # within the overlap
    await r.gateway.admit(sdk_signed(r, new, "s4"))
    r.clock.now += 11
    assert await code_of(r, sdk_signed(r, raw, "s5")) is ErrorCode.unauthorized
    revoked = sdk_signed(r, new, "s6")
    await r.keys.revoke(record.key_id)
    assert await code_of(r, revoked) is ErrorCode.unauthorized
    store = MemoryKeyStore(r.clock)  # a record made before keys had a signing pair: its key must be rotated
    old = Gateway(GatewaySettings(auth_required=True, key_cache_s=0.0), store, MemoryLimiter(60.0, r.clock), clock=r.clock)
    legacy_raw, legacy = await KeyManager(store, rotate_overlap_s=0, clock=r.clock).create("acme")
    await store.save(msgspec.structs.replace(legacy, verify_keys={}))
    with pytest.raises(StageError) as caught:
        await old.admit(sdk_signed(r, legacy_raw, "s7"))
    assert caught.value.code is ErrorCode.unauthorized


async def test_raw_keys_refuse_turns_away_a_key_written_into_the_record_but_not_a_signed_one() -> None:
    """gateway.raw_keys = "refuse": a direct producer that writes its key into the record is told to sign."""
    r = rig(raw_keys="refuse")
    raw, record = await r.keys.create("acme")
    with pytest.raises(StageError) as caught:
        await r.gateway.admit(request("raw", api_key=raw))
    assert caught.value.code is ErrorCode.unauthorized and "sign the request" in caught.value.message
    assert raw not in caught.value.message
    _, principal = await r.gateway.admit(sdk_signed(r, raw))
    assert principal.name == "key:" + record.key_id
    anonymous = rig(raw_keys="refuse", auth_required=False)
    forwarded, _ = await anonymous.gateway.admit(request("anon", api_key="unused"))  # not a sluice key
    assert forwarded.tenant == "default"

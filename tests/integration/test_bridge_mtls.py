"""The bridge with mutual TLS: uvicorn with a client CA generated here. A client with a certificate the
CA signed gets in; one without a certificate, with a self-signed one, or over plain HTTP does not."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline import kafka
from pipeline.bridge import serve
from pipeline.gateway.config import TlsSettings
from pipeline.sdk import Client
from pipeline.settings import Settings
from tests.integration.gateway_fixtures import wait_healthy, with_gateway
from tests.ports import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(path: Path, cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, *, ca: bool = False,
          server: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_cert, signer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(signer_cert.subject if signer_cert else _name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return cert, key


def client_context(tmp: Path, cert: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
    if cert is not None:
        context.load_cert_chain(str(tmp / f"{cert}.pem"), str(tmp / f"{cert}.key"))
    return context


async def test_only_clients_with_a_certificate_from_the_ca_get_in(settings: Settings, tmp_path: Path) -> None:
    ca = issue(tmp_path / "ca", "sluice test CA", None, ca=True)
    issue(tmp_path / "server", "127.0.0.1", ca, server=True)
    issue(tmp_path / "client", "service-a", ca)
    issue(tmp_path / "rogue", "rogue", None)
    tls = TlsSettings(certfile=str(tmp_path / "server.pem"), keyfile=str(tmp_path / "server.key"), client_ca=str(tmp_path / "ca.pem"))
    configured = with_gateway(settings, tls=tls)
    configured = replace(configured, bridge=replace(configured.bridge, port=free_port()))
    await kafka.create_topics(configured)
    url = f"https://127.0.0.1:{configured.bridge.port}"
    stop = asyncio.Event()
    async with Client(configured, reply_name=configured.bridge.reply_name) as client:
        serving = asyncio.create_task(serve(configured, client, stop))
        try:
            await wait_healthy(url, serving, verify=client_context(tmp_path, "client"))
            async with httpx.AsyncClient(base_url=url, verify=client_context(tmp_path, "client")) as http:
                assert (await http.get("/v1/models")).status_code == 200
            for cert in (None, "rogue"):
                async with httpx.AsyncClient(base_url=url, verify=client_context(tmp_path, cert)) as http:
                    with pytest.raises(httpx.TransportError):
                        await http.get("/healthz")
            async with httpx.AsyncClient(base_url=url.replace("https", "http")) as http:
                with pytest.raises(httpx.TransportError):
                    await http.get("/healthz")
        finally:
            stop.set()
            await serving

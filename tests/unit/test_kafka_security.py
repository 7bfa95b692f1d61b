"""`[gateway.kafka] protocol = "SASL_SSL"` gives every Kafka client a TLS context that verifies the broker
(against `cafile`, else the system's CAs): aiokafka refuses SASL_SSL without one, in every client. Every
client is the producer, the group and broadcast consumers and the admin client (pipeline/kafka.py) and
the usage CLI's consumer (pipeline/observability/usage_cli.py): each place that passes `security(...)`."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import certifi
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from pipeline import kafka
from pipeline.observability import usage_cli
from pipeline.settings import Settings, SettingsError, load

SASL_SSL = '[gateway.kafka]\nprotocol = "SASL_SSL"\nusername = "sluice"\npassword = "pw"\n'


def load_text(tmp_path: Path, text: str) -> Settings:
    (tmp_path / "sluice.toml").write_text(text)
    return load(tmp_path / "sluice.toml", {})


class Held(Exception):
    """Raised by `start`: a client that the code under test makes and starts at once is kept unstarted."""


@pytest.mark.asyncio
@pytest.mark.parametrize("cafile", ["", certifi.where()])
async def test_every_client_starts_under_sasl_ssl_with_a_verifying_context(
    tmp_path: Path, cafile: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_text(tmp_path, SASL_SSL + (f'cafile = "{cafile}"\n' if cafile else ""))
    started: list[Any] = []

    async def hold(client: Any) -> None:
        started.append(client)
        raise Held

    monkeypatch.setattr(AIOKafkaConsumer, "start", hold)
    monkeypatch.setattr(AIOKafkaAdminClient, "start", hold)
    producer = kafka.producer(settings, "test")  # these raised "`ssl_context` is mandatory" before
    consumer = kafka.group_consumer(settings, "g", ("llm.requests",), "test")
    try:
        for make in (lambda: kafka.create_topics(settings),
                     lambda: kafka.broadcast_consumer(settings, ("llm.requests",), "test"),
                     lambda: usage_cli.read_since(settings, 0.0)):
            with pytest.raises(Held):
                await make()
        assert [made._client._client_id for made in started] == ["sluice-admin", "test", "sluice-usage"]
        for client in (producer.client, consumer._client, *(made._client for made in started)):
            context = client._ssl_context
            assert isinstance(context, ssl.SSLContext), client
            assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname, client
    finally:
        await producer.stop()
        await consumer.stop()
        for made in started:
            await (made.close() if isinstance(made, AIOKafkaAdminClient) else made.stop())


def test_plaintext_and_sasl_plaintext_have_no_tls(tmp_path: Path) -> None:
    assert kafka.security(load_text(tmp_path, "")) == {}
    assert "ssl_context" not in kafka.security(load_text(tmp_path, SASL_SSL.replace("SASL_SSL", "SASL_PLAINTEXT")))


@pytest.mark.parametrize(("text", "expected"), [
    (SASL_SSL + 'cafile = "/nonexistent/ca.pem"\n', "gateway.kafka.cafile: no such file '/nonexistent/ca.pem'"),
    (SASL_SSL.replace("SASL_SSL", "SASL_PLAINTEXT") + f'cafile = "{certifi.where()}"\n',
     'gateway.kafka.cafile is for protocol = "SASL_SSL" only'),
])
def test_a_cafile_that_cannot_work_is_refused_at_load(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, text)
    assert expected in str(caught.value)

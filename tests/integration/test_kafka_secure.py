"""The broker's secure profile: SASL/SCRAM and ACLs. A tenant may write requests and read its own reply
topic; it cannot read another tenant's replies or write to a stage topic; a wrong password gets nowhere;
sluice's own clients connect with the settings' credentials."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from pipeline import kafka
from pipeline.gateway.config import KafkaSecurity
from pipeline.settings import KafkaSettings, Settings
from tests.integration.gateway_fixtures import SecureBroker, secure_broker

__all__ = ["secure_broker"]
pytestmark = pytest.mark.asyncio(loop_scope="session")


def admin_settings(broker: SecureBroker) -> Settings:
    security = KafkaSecurity(protocol="SASL_PLAINTEXT", username="admin", password=broker.admin_password)
    settings = Settings()
    return replace(settings, kafka=KafkaSettings(bootstrap=broker.bootstrap, partitions=1),
                   gateway=replace(settings.gateway, kafka=security))


async def read_all(broker: SecureBroker, user: str, password: str, topic: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, auto_offset_reset="earliest",
                                **broker.client_options(user, password))
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        batch = await consumer.getmany(timeout_ms=3000)
        return [r.value or b"" for records in batch.values() for r in records]
    finally:
        await consumer.stop()


async def test_tenants_are_confined_to_their_own_topics(secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture) -> None:
    settings = admin_settings(secure_broker)
    created = await kafka.create_topics(replace(settings, replies=("alpha", "beta", "bridge"), bridge=settings.bridge))
    assert "llm.responses.alpha" in created and "llm.admitted" in created  # sluice's admin path speaks SASL
    for tenant in ("alpha", "beta"):
        await asyncio.to_thread(secure_broker.add_tenant, tenant, tenant + "-password")

    stage = kafka.producer(settings, "stage-emit")  # a stage (the super user) writes both tenants' replies
    await stage.start()
    await stage.send_and_wait("llm.responses.alpha", b"answer for alpha")
    await stage.send_and_wait("llm.responses.beta", b"answer for beta")
    await stage.stop()

    alpha = AIOKafkaProducer(bootstrap_servers=secure_broker.bootstrap, enable_idempotence=True, acks="all",
                             **secure_broker.client_options("alpha", "alpha-password"))
    await alpha.start()
    try:
        await alpha.send_and_wait("llm.requests", b"a request")  # allowed: ingest authenticates it on its own
        for stage_topic in ("llm.admitted", "llm.tokens", "llm.dlq", "llm.responses.beta"):
            with pytest.raises(TopicAuthorizationFailedError):
                await asyncio.wait_for(alpha.send_and_wait(stage_topic, b"injected"), 20)
    finally:
        await alpha.stop()

    assert await read_all(secure_broker, "alpha", "alpha-password", "llm.responses.alpha") == [b"answer for alpha"]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="aiokafka"):
        assert await read_all(secure_broker, "alpha", "alpha-password", "llm.responses.beta") == []
    assert "not authorized" in caplog.text
    assert await read_all(secure_broker, "beta", "beta-password", "llm.responses.beta") == [b"answer for beta"]


async def test_a_wrong_password_cannot_connect(secure_broker: SecureBroker) -> None:
    intruder = AIOKafkaProducer(bootstrap_servers=secure_broker.bootstrap, **secure_broker.client_options("alpha", "guess"))
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(intruder.start(), 30)
    await intruder.stop()


async def test_the_brokers_secrets_are_private_files_and_never_arguments(secure_broker: SecureBroker) -> None:
    """server.properties and the password file are mode 600; the format step's argument file is gone; no
    process shows the admin password in its command line."""
    state = secure_broker.admin_password_file.parent
    for name in ("server.properties", "kafka-admin.password"):
        assert (state / name).stat().st_mode & 0o777 == 0o600, name
    assert state.stat().st_mode & 0o777 == (state / "kafka-data").stat().st_mode & 0o777 == 0o700
    assert secure_broker.admin_password in (state / "server.properties").read_text()
    assert not list(state.glob("format.args*")) and not list(state.glob("server.properties.*"))
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert secure_broker.admin_password.encode() not in cmdline.read_bytes()
        except OSError:
            continue

"""Kafka clients built from settings, and topic creation. The runner, the reply listener and the
admin command get their clients here; stages never do."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import TopicPartition

from pipeline import offset_fetch
from pipeline.settings import Settings
from topics.registry import TopicSpec, all_topics

log = logging.getLogger(__name__)
offset_fetch.install()  # every group consumer of the process starts from its committed offsets, never from 0 by mistake


def security(settings: Settings) -> dict[str, Any]:
    """The SASL options of every client (the secure profile), from `[gateway.kafka]`; none for PLAINTEXT.
    SASL_SSL verifies the broker's certificate against `cafile` (empty: the system's CAs): aiokafka
    refuses an SSL protocol without a context."""
    sec = settings.gateway.kafka
    if sec.protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {
        "security_protocol": sec.protocol,
        "sasl_mechanism": sec.mechanism,
        "sasl_plain_username": sec.username,
        "sasl_plain_password": sec.password,
    }
    if sec.protocol == "SASL_SSL":
        options["ssl_context"] = create_ssl_context(cafile=sec.cafile or None)
    return options


def producer(settings: Settings, client_id: str, linger_ms: int | None = None) -> AIOKafkaProducer:
    """Idempotent, acks from all in-sync replicas, so an acknowledged message is never duplicated by retries.
    `linger_ms`: `kafka.linger_ms` unless given."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap,
        client_id=client_id,
        enable_idempotence=True,
        acks="all",
        linger_ms=settings.kafka.linger_ms if linger_ms is None else linger_ms,
        request_timeout_ms=30000,
        **security(settings),
    )


def group_consumer(settings: Settings, group: str, topics: tuple[str, ...], client_id: str) -> AIOKafkaConsumer:
    """A member of consumer group `group`; offsets are committed by the runner, never automatically."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=settings.kafka.bootstrap,
        group_id=group,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        fetch_max_wait_ms=500,
        max_poll_interval_ms=600000,
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        # A join waits this long for members to rejoin: a stuck member must not hold the group for minutes.
        rebalance_timeout_ms=max(10000, settings.kafka.session_timeout_ms * 3),
        **security(settings),
    )


async def broadcast_consumer(
    settings: Settings, topics: tuple[str, ...], client_id: str, timeout_s: float = 30.0, *, from_start: bool = False,
) -> AIOKafkaConsumer:
    """A started consumer outside any group that reads every partition of `topics` from their current end
    (or, `from_start`, from their beginning: a compacted table read whole).

    It returns once it holds every partition and knows its position, so nothing produced after the call
    is missed (a reply listener must be in place before its request is sent). The partitions are assigned
    by hand, once: a subscription would be re-assigned, and reset to the end, whenever a metadata refresh
    under load briefly lacks a topic, skipping what was produced meanwhile. Partitions added to a topic
    later are not read until the consumer is made again."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap,
        client_id=client_id,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="latest",
        fetch_max_wait_ms=500,
        **security(settings),
    )
    try:
        await consumer.start()
        consumer.assign([TopicPartition(topic, 0) for topic in topics])  # makes the client fetch their metadata
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(consumer.partitions_for_topic(topic) for topic in topics):
            if asyncio.get_running_loop().time() > deadline:
                raise LookupError(f"no partitions for {topics} after {timeout_s} s: run `sluice topics create`")
            await asyncio.sleep(0.05)
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t))]
        consumer.assign(partitions)
        if from_start:
            await consumer.seek_to_beginning(*partitions)
        else:
            await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)
    except BaseException:
        await consumer.stop()
        raise
    return consumer


def topic_specs(settings: Settings) -> list[TopicSpec]:
    return all_topics(
        pools=settings.pools,
        unsplit=settings.unsplit_pools,
        replies=settings.replies,
        partitions=settings.kafka.partitions,
    )


async def _warm_group_coordinator(admin: AIOKafkaAdminClient, timeout_s: float = 30.0) -> None:
    """Makes the broker create its offsets topic now, so stages joining their groups right after do not
    first see (and log) GroupCoordinatorNotAvailable."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await admin.find_coordinator("sluice-warm-up")
            return
        except KafkaError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def create_topics(settings: Settings) -> list[str]:
    """Creates every declared topic that does not exist yet; returns the names it created. A topic the
    broker refuses (not authorised, an invalid config) raises its `KafkaError`, whose `retriable` says
    whether trying again may help."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, client_id="sluice-admin", **security(settings))
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [s for s in topic_specs(settings) if s.name not in existing]
        await _warm_group_coordinator(admin)
        if not wanted:
            return []
        new = [NewTopic(s.name, s.partitions, 1, topic_configs=s.config) for s in wanted]
        response = await admin.create_topics(new)  # errors come per topic in the response, not raised
        for topic, code, *message in response.topic_errors:
            if code == TopicAlreadyExistsError.errno:
                log.info("topic %s was created concurrently", topic)
            elif code:
                raise for_code(code)(f"creating topic {topic}: {message[0] if message and message[0] else 'refused'}")
        return [s.name for s in wanted]
    finally:
        await admin.close()


async def started(make: Callable[[], Any], stop: asyncio.Event, name: str, subscribe: tuple[Any, Any] | None = None) -> Any:
    """A started Kafka client (`make()`, subscribed if asked); while the broker cannot be reached, tries
    again with backoff until `stop` is set."""
    backoff = 0.5
    while True:
        client = make()
        if subscribe is not None:
            client.subscribe(list(subscribe[0]), listener=subscribe[1])
        try:
            await client.start()
            return client
        except BaseException as exc:  # a start cut short (cancelled too) leaves connections open until stopped
            await client.stop()
            if not isinstance(exc, KafkaError) or stop.is_set():
                raise
            log.warning("%s cannot reach the broker, retrying in %.1f s: %s", name, backoff, type(exc).__name__)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

"""Cost on terminal events and the metrics emit counts per finished request: bounded labels, guard
reasons, rate-limit scopes; the scrape-time collectors; the lag watch; the settings' checks."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from prometheus_client import REGISTRY

from pipeline import metrics
from pipeline.gateway.config import ModelPrice
from pipeline.observability import collectors, costs, setup
from pipeline.observability.config import ObservabilitySettings
from pipeline.observability.lag import LagWatch
from tests.ports import free_port
from topics.errors import ErrorCode
from topics.stream import Done, Failed, FinishReason, RateLimit, Usage

PRICES = {"m": ModelPrice(prompt_per_1k=0.5, completion_per_1k=1.5)}


def done(**kw) -> Done:
    fields = dict(id="acme/1", reply_to="llm.responses.sdk", chunks=1, digest="d", finish_reason=FinishReason.stop,
                  usage=Usage(1000, 2000), tenant="acme", model="m", created_at=0.0)
    return Done(**{**fields, **kw})


def failed(code: ErrorCode, message: str, **kw) -> Failed:
    return Failed(id="acme/2", reply_to="llm.responses.sdk", code=code, message=message, retriable=False, tenant="acme",
                  model="m", created_at=0.0, **kw)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_cost_is_tokens_at_the_configured_prices() -> None:
    assert costs.cost(PRICES, "m", Usage(1000, 2000)) == pytest.approx(0.5 + 3.0)
    assert costs.cost(PRICES, "unpriced", Usage(1000, 2000)) == 0.0
    priced = costs.priced(done(), PRICES, Usage(1000, 2000))
    assert priced.cost == pytest.approx(3.5)
    assert costs.priced(done(), PRICES, Usage()).cost == 0.0  # a free cache hit


def test_tenant_labels_are_bounded_to_configured_tenants() -> None:
    label = costs.TenantLabels(frozenset({"acme", "default"}))
    assert label("acme") == "acme" and label("somebody-else") == costs.OTHER


def test_observe_counts_outcome_tokens_cost_and_reasons() -> None:
    before = (sample("sluice_requests_total", model_name="m", outcome="stop"), sample("sluice_cost_total", tenant="acme", model_name="m"),
              sample("sluice_generation_tokens_total", model_name="m"))
    costs.observe(costs.priced(done(), PRICES, Usage(1000, 2000)), "acme", frozenset({"m"}))
    assert sample("sluice_requests_total", model_name="m", outcome="stop") == before[0] + 1
    assert sample("sluice_cost_total", tenant="acme", model_name="m") == pytest.approx(before[1] + 3.5)
    assert sample("sluice_generation_tokens_total", model_name="m") == before[2] + 2000

    injection = sample("sluice_guard_refusals_total", reason="prompt_injection")
    costs.observe(failed(ErrorCode.content_filter, "prompt_injection: refused"), "acme", frozenset({"m"}))
    assert sample("sluice_guard_refusals_total", reason="prompt_injection") == injection + 1
    other = sample("sluice_guard_refusals_total", reason="other")
    costs.observe(failed(ErrorCode.content_filter, "anything a client could make up: x"), "acme", frozenset({"m"}))
    assert sample("sluice_guard_refusals_total", reason="other") == other + 1

    limited = sample("sluice_rate_limit_refusals_total", scope="key", resource="tokens")
    costs.observe(failed(ErrorCode.rate_limited, "slow down", rate_limit=RateLimit("key", "tokens", 10, 0, 1.0)), "acme", frozenset({"m"}))
    assert sample("sluice_rate_limit_refusals_total", scope="key", resource="tokens") == limited + 1
    unknown_model = sample("sluice_requests_total", model_name="other", outcome="stop")
    costs.observe(done(model="a-model-nobody-configured"), "acme", frozenset({"m"}))
    assert sample("sluice_requests_total", model_name="other", outcome="stop") == unknown_model + 1


def test_engine_and_health_collectors_read_at_scrape_time() -> None:
    class Engine:  # an LLMEngine's shape
        scheduler = SimpleNamespace(running=[1, 2], waiting=[1, 2, 3], spec_proposed=5, spec_accepted=3)
        block_manager = SimpleNamespace(num_blocks=10, num_free_blocks=4)
        interrupted_steps = 7

    engine = Engine()
    collectors.watch_engine("unit-engine", engine)
    assert sample("sluice_num_requests_running", engine="unit-engine") == 2
    assert sample("sluice_num_requests_waiting", engine="unit-engine") == 3
    assert sample("sluice_kv_cache_usage_perc", engine="unit-engine") == pytest.approx(0.6)
    assert sample("sluice_engine_spec_tokens_total", engine="unit-engine", outcome="proposed") == 5
    assert sample("sluice_engine_spec_tokens_total", engine="unit-engine", outcome="accepted") == 3
    assert sample("sluice_engine_interrupted_steps_total", engine="unit-engine") == 7

    class View:
        def member(self, name: str, now: float) -> SimpleNamespace:
            return SimpleNamespace(ejected=name == "bad")

    view = View()
    collectors.watch_health(view, ("bad", "good"))
    assert sample("sluice_backend_ejected", backend="bad") == 1.0
    assert sample("sluice_backend_ejected", backend="good") == 0.0
    del engine, view  # held weakly: gone from the output with their owners
    assert REGISTRY.get_sample_value("sluice_num_requests_running", {"engine": "unit-engine"}) is None


@pytest.mark.asyncio
async def test_lag_is_high_watermark_minus_position_and_forgets_revoked_partitions() -> None:
    tps = [TopicPartition("llm.unit", 0), TopicPartition("llm.unit", 1)]

    class Consumer:
        owned = list(tps)

        def assignment(self) -> set[TopicPartition]:
            return set(self.owned)

        def highwater(self, tp: TopicPartition) -> int:
            return 100

        async def position(self, tp: TopicPartition) -> int:
            return 90 + tp.partition

    watch, consumer = LagWatch("unit-stage", interval_s=0.0), Consumer()
    watch.observe(consumer)
    await asyncio.wait_for(watch._task, 5)  # the reading it started (the loop may be busy: no fixed sleep)
    assert sample("sluice_consumer_lag", stage="unit-stage", topic="llm.unit", partition="0") == 10
    assert sample("sluice_consumer_lag", stage="unit-stage", topic="llm.unit", partition="1") == 9
    consumer.owned = tps[:1]
    watch.observe(consumer)
    await asyncio.wait_for(watch._task, 5)  # the reading it started (the loop may be busy: no fixed sleep)
    assert REGISTRY.get_sample_value("sluice_consumer_lag", {"stage": "unit-stage", "topic": "llm.unit", "partition": "1"}) is None


def test_probe_and_addresses() -> None:
    assert setup._address("127.0.0.1:19092", 9092) == ("127.0.0.1", 19092)
    assert setup._address("redis-host", 6379) == ("redis-host", 6379)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert setup.probe(listening.getsockname())
    assert not setup.probe(("127.0.0.1", free_port()), timeout_s=0.2)  # a port nothing listens on


@pytest.mark.parametrize(("changes", "problem"), [
    ({"sample_ratio": 1.5}, "sample_ratio"),
    ({"otlp_endpoint": "127.0.0.1:4317"}, "otlp_endpoint"),
    ({"export_batch": 10_000}, "export_batch"),
    ({"metrics_port": 70000}, "metrics_port"),
])
def test_settings_refuse_what_cannot_work(changes: dict, problem: str) -> None:
    assert any(problem in p for p in ObservabilitySettings(**changes).problems())
    assert ObservabilitySettings().problems() == []


def test_stage_histograms_are_vllm_shaped() -> None:
    assert len(metrics.TTFT_BUCKETS) == 22 and len(metrics.ITL_BUCKETS) == 19 and len(metrics.REQUEST_BUCKETS) == 21


def test_a_client_side_watch_labels_a_model_no_one_configured_other() -> None:
    from pipeline.observability.watch import RequestWatch
    from tests.unit.helpers import request

    made_up = RequestWatch(request("w1", model="made-up-1234"), models=("smollm2-135m-instruct",))
    known = RequestWatch(request("w2", model="smollm2-135m-instruct"), models=("smollm2-135m-instruct",))
    assert (made_up.model, known.model) == ("other", "smollm2-135m-instruct")
    made_up.finish(None)
    known.finish(None)

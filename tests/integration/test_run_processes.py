"""`sluice run --processes 2`: the bridge and every stage in each process, on one port (`[run] bridges =
"every"`), or the bridge in the first only ("first"); each stage's consumer group has both as members,
and requests through the bridge are answered whole (a non-streaming answer from the instant backend is
one chunk message). With a bridge in each, both serve requests and /metrics answers for both. With an
OTLP endpoint, each process has its span export child, the spans reach the endpoint, and no child
outlives the run. Own Kafka and Redis on free ports, so no other stack's consumer groups mix in."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from bench.services import own_services
from tests.integration.test_make_run import cmdline, descendants
from tests.ports import free_ports
from tests.unit.observability.test_otlp import sink  # noqa: F401 (a fixture: an OTLP/HTTP receiver)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

CONFIG = """
profile = "transport"
replies = ["bridge", "sdk"]
[profiles]
transport = ["ingest", "cache", "route", "prefill", "decode", "emit"]
[bridge]
port = {port}
[run]
processes = 1
bridges = "{bridges}"
[[backends]]
name = "instant"
kind = "instant"
model = "instant-model"
pool = "instant"
split = false
[cache]
enabled = false
"""


def _exporters(pid: int) -> list[psutil.Process]:
    return [psutil.Process(p) for p in descendants(pid) if "export_child" in cmdline(p)]


def _members(bootstrap: str, group: str) -> int:
    async def count() -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            [description] = await admin.describe_consumer_groups([group])
            return len(description.groups[0][5])  # DescribeGroupsResponse: (error, id, state, type, protocol, members)
        finally:
            await admin.close()

    return asyncio.run(count())


@pytest.mark.parametrize("bridges", ["every", "first"])
def test_two_processes_share_every_stage_and_answer_through_the_bridge(
        tmp_path: Path, sink: tuple[str, list[tuple[str, bytes]]], bridges: str) -> None:  # noqa: F811
    kafka_port, _, redis_port, bridge_port = free_ports(4)
    config = tmp_path / "sluice.toml"
    config.write_text(CONFIG.format(port=bridge_port, bridges=bridges))
    otlp, posted = sink
    exporters: list[psutil.Process] = []
    with own_services(f"test-processes-{kafka_port}", kafka_port, redis_port) as service_env:
        env = {**os.environ, **service_env, "SLUICE_CONFIG": str(config), "SLUICE_OTLP_ENDPOINT": otlp + "/v1/traces",
               "TMPDIR": str(tmp_path)}
        log = (tmp_path / "run.log").open("wb")
        run = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "--processes", "2"], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{bridge_port}/v1/chat/completions"
            body = {"model": "instant-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": 16}
            deadline, answered = time.monotonic() + 120, None
            while time.monotonic() < deadline and answered is None:
                try:
                    answered = httpx.post(url, json=body, timeout=10)
                except httpx.HTTPError:
                    time.sleep(0.5)
            assert answered is not None and answered.status_code == 200, (tmp_path / "run.log").read_text()[-3000:]

            children = [cmdline(p) for p in descendants(run.pid)]
            if bridges == "every":
                assert sum("--in-process --shared-port" in c for c in children) == 2, children
            else:
                assert sum("--in-process" in c for c in children) == 1 and sum(" worker" in c for c in children) == 1, children
            bootstrap = service_env["SLUICE_KAFKA_BOOTSTRAP"]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _members(bootstrap, "ingest") < 2:
                time.sleep(1)
            assert _members(bootstrap, "ingest") == 2 and _members(bootstrap, "generate.instant") == 2

            expected = "".join(f"t{i} " for i in range(16))
            for i in range(20):
                body["messages"][0]["content"] = f"count {i}"
                reply = httpx.post(url, json=body, timeout=30)
                assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: {")]
            assert 2 <= len(events) <= 17  # the first token alone, the rest as the backend produced them
            if bridges == "every":  # each process served some of the 20 (a connection each), and /metrics says so
                assert len(list(tmp_path.glob("sluice-run-*/*.sock"))) == 2
                served = _ingested(httpx.get(f"http://127.0.0.1:{bridge_port}/metrics", timeout=10).text)
                assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()) and sum(served.values()) >= 21, served

            deadline = time.monotonic() + 30  # the batch processors export every second
            while time.monotonic() < deadline and not {"ingest", "emit"} <= _span_names(posted):
                time.sleep(0.5)
            assert {"ingest", "route", "emit"} <= _span_names(posted), _span_names(posted)
            deadline = time.monotonic() + 30  # each child starts with its process's first export, a second or so apart
            while time.monotonic() < deadline and len(_exporters(run.pid)) < 2:
                time.sleep(0.5)
            exporters = _exporters(run.pid)
            assert len(exporters) == 2, [cmdline(p) for p in descendants(run.pid)]  # one per sluice process
        finally:
            run.send_signal(signal.SIGTERM)
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
            log.close()
        assert run.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie" for p in exporters):
            time.sleep(0.2)
        assert not any(p.is_running() and p.status() != "zombie" for p in exporters)  # none outlives its process
        assert not list(tmp_path.glob("sluice-run-*"))  # the metrics sockets' directory is gone with the run


def _ingested(metrics: str) -> dict[str, float]:
    """Requests ingest finished, by the process that answered for them (`sluice_process`)."""
    return {s.labels["sluice_process"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
            if s.name == "sluice_messages_total" and s.labels.get("stage") == "ingest" and s.labels.get("outcome") == "ok"}


def _span_names(posted: list[tuple[str, bytes]]) -> set[str]:
    return {span.name for _, body in list(posted) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for span in ss.spans}

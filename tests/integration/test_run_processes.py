"""`sluice run --processes 2`: the bridge and every stage in one process, every stage again in a second;
each stage's consumer group has both as members, and requests through the bridge are answered whole
(a non-streaming answer from the instant backend is one chunk message). With an OTLP endpoint, each
process has its span export child, the spans reach the endpoint, and no child outlives the run. Own
Kafka and Redis on free ports, so no other stack's consumer groups mix in."""

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

from bench.services import own_services
from tests.integration.conftest import free_ports
from tests.integration.test_make_run import cmdline, descendants
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
[[backends]]
name = "instant"
kind = "instant"
model = "instant-model"
pool = "instant"
split = false
[cache]
enabled = false
"""


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


def test_two_processes_share_every_stage_and_answer_through_the_bridge(
        tmp_path: Path, sink: tuple[str, list[tuple[str, bytes]]]) -> None:  # noqa: F811
    kafka_port, _, redis_port, bridge_port = free_ports(4)
    config = tmp_path / "sluice.toml"
    config.write_text(CONFIG.format(port=bridge_port))
    otlp, posted = sink
    exporters: list[psutil.Process] = []
    with own_services(f"test-processes-{kafka_port}", kafka_port, redis_port) as service_env:
        env = {**os.environ, **service_env, "SLUICE_CONFIG": str(config), "SLUICE_OTLP_ENDPOINT": otlp + "/v1/traces"}
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

            deadline = time.monotonic() + 30  # the batch processors export every second
            while time.monotonic() < deadline and not {"ingest", "emit"} <= _span_names(posted):
                time.sleep(0.5)
            assert {"ingest", "route", "emit"} <= _span_names(posted), _span_names(posted)
            exporters = [psutil.Process(p) for p in descendants(run.pid) if "export_child" in cmdline(p)]
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


def _span_names(posted: list[tuple[str, bytes]]) -> set[str]:
    return {span.name for _, body in list(posted) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for span in ss.spans}

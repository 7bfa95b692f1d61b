"""A 10,000-line batch job survives its workers being SIGKILLed three times and the broker restarting once.

Own Kafka and Redis (SLUICE_BATCH_CHAOS_PORTS=K,R; below the ephemeral range so a restarted broker can
bind its port again), two worker processes as `sluice run` would supervise them (every stage of the
bare profile on the instant backend in one, `sluice batch worker` in the other, each restarted about a
second after it dies), and the job made as the bridge makes one (file under batch.dir, record in Redis).
First an undisturbed job over the same file gives the reference; then the faulted one. Checked: exactly
10,000 output plus error lines, each custom_id once, every body's answer and usage identical to the
reference, lines run again no more than the lines in flight at the faults, and how long each kill took
to resume. `python -m tests.integration.test_batch_faults` prints the report; pytest runs it with -m chaos.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline import settings as settings_module
from pipeline.batch.records import TERMINAL, Batch, Status, new_batch_id
from pipeline.batch.service import file_store, job_store
from pipeline.settings import Settings
from tests.chaos.harness import PYTHON, ROOT, Ports, Services, worker_env, write_config
from tests.chaos.harness import _toml as toml_lines
from tests.chaos.scenarios import BARE
from topics import codec
from topics.requests import Request

LINES = int(os.environ.get("SLUICE_BATCH_CHAOS_LINES", "10000"))
CHAT = "/v1/chat/completions"
MAX_TOKENS = 6


def input_file(n: int) -> bytes:
    rows = ({"custom_id": f"line-{i:05d}", "method": "POST", "url": CHAT,
             "body": {"model": "instant", "max_tokens": MAX_TOKENS - i % 3,
                      "messages": [{"role": "user", "content": f"prompt number {i}"}]}} for i in range(n))
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    kills: int = 0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([str(PYTHON), "-m", "pipeline.cli", *self.argv], cwd=ROOT, env=self.env,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.kills += 1

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Report:
    lines: int
    reference_s: float = 0.0
    faulted_s: float = 0.0
    faults: list[str] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)  # per batch-worker kill: until progress moved again
    output_lines: int = 0
    error_lines: int = 0
    custom_ids_once: bool = False
    bodies_identical: bool = False
    requests_sent: int = 0  # requests on llm.requests for the faulted job's prompts
    problems: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        return "\n".join([
            f"lines {self.lines}: undisturbed {self.reference_s:.1f} s, faulted {self.faulted_s:.1f} s",
            f"faults: {', '.join(self.faults)}",
            f"resumed after each batch-worker kill in: {', '.join(f'{s:.1f} s' for s in self.resume_s)}",
            f"output lines {self.output_lines} + error lines {self.error_lines}; each custom_id once: {self.custom_ids_once}; "
            f"bodies identical to the undisturbed run: {self.bodies_identical}",
            f"requests sent {self.requests_sent} for {self.lines} lines (run again: {self.requests_sent - self.lines})",
            f"problems: {self.problems or 'none'}",
        ])


async def make_job(settings: Settings, data: bytes) -> str:
    files, store = file_store(settings), job_store(settings)
    try:
        record = await asyncio.to_thread(files.upload, settings.gateway.anonymous_tenant, "in.jsonl", io.BytesIO(data))
        now = int(time.time())
        batch = Batch(new_batch_id(), settings.gateway.anonymous_tenant, record.id, CHAT, now, now + 24 * 3600)
        await store.create(batch)
        return batch.id
    finally:
        await store.aclose()


async def progress(settings: Settings, batch_id: str) -> tuple[Status | None, int]:
    store = job_store(settings)
    try:
        batch = await store.get(batch_id)
        counts = await store.counts(batch_id)
        return (batch.status if batch else None), counts.completed + counts.failed
    except Exception:  # noqa: BLE001 - Redis is never faulted here, but a slow answer must not end the run
        return None, -1
    finally:
        await store.aclose()


async def wait_done(settings: Settings, batch_id: str, timeout_s: float) -> Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, _ = await progress(settings, batch_id)
        if status in TERMINAL:
            store = job_store(settings)
            try:
                batch = await store.get(batch_id)
            finally:
                await store.aclose()
            assert batch is not None
            return batch
        await asyncio.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} did not end within {timeout_s} s")


async def wait_progress(settings: Settings, batch_id: str, at_least: int, timeout_s: float) -> float:
    """Seconds until the job has at least `at_least` outcomes."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        _, done = await progress(settings, batch_id)
        if done >= at_least:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise TimeoutError(f"batch {batch_id}: fewer than {at_least} outcomes after {timeout_s} s")


def outcomes(settings: Settings, batch: Batch) -> dict[str, dict[str, Any]]:
    files = file_store(settings)
    lines: list[dict[str, Any]] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            lines += [json.loads(x) for x in files.path(files.get(batch.tenant, file_id)).read_bytes().splitlines()]
    by_id: dict[str, dict[str, Any]] = {}
    for line in lines:
        by_id.setdefault(line["custom_id"], line)
    return {"__count__": len(lines), "__ids__": len(by_id), **by_id}  # type: ignore[dict-item]


def essence(line: dict[str, Any]) -> Any:
    """What must not change between runs: the answer and its usage (ids and timestamps do)."""
    response = line.get("response") or {}
    body = response.get("body") or {}
    return response.get("status_code"), body.get("choices"), body.get("usage"), line.get("error")


async def count_requests(bootstrap: str, partitions: int, since: float) -> int:
    """Batch-lane requests on llm.requests made at or after `since` (the faulted job's: the reference ended before)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await consumer.start()
    seen = 0
    try:
        assigned = [TopicPartition("llm.requests", p) for p in range(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        end = await consumer.end_offsets(assigned)
        while True:
            behind = [tp for tp in assigned if await consumer.position(tp) < end[tp]]
            if not behind:
                break
            batch = await consumer.getmany(*behind, timeout_ms=1000)
            for records in batch.values():
                for record in records:
                    request = codec.decode(record.value or b"", Request)
                    if request.priority.value == "batch" and request.created_at >= since:
                        seen += 1
    finally:
        await consumer.stop()
    return seen


async def run(lines: int = LINES) -> Report:
    report = Report(lines)
    ports = Ports(*(int(p) for p in os.environ.get("SLUICE_BATCH_CHAOS_PORTS", "30192,30479").split(",")))
    state = ROOT / ".state" / f"batch-chaos-{ports.kafka}"
    shutil.rmtree(state, ignore_errors=True)
    services = Services(ports, state)
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            await services.start()
            config = write_config(Path(tmp) / "sluice.toml", services, token_delay_ms=0.0, stages=BARE)
            raw = tomllib.loads(config.read_text())
            raw["batch"] = {**raw.get("batch", {}), "dir": str(state / "files"), "lease_s": 3.0, "max_in_flight": 32,
                            "admission_rps": 0.0}
            config.write_text("\n".join(toml_lines(raw)) + "\n")
            env = worker_env(config, services)
            settings = settings_module.load(env=env)
            subprocess.run([str(PYTHON), "-m", "pipeline.cli", "topics", "create"], cwd=ROOT, env=env, check=True,
                           stdout=subprocess.DEVNULL)
            stages = Proc("stages", ["worker", "ingest", "route", "prefill", "decode", "emit"], env, state / "stages.log")
            worker = Proc("batch", ["batch", "worker"], env, state / "batch.log")
            procs += [stages, worker]
            for p in procs:
                p.start()
            reference_data = input_file(lines)
            started = time.monotonic()
            reference = await wait_done(settings, await make_job(settings, reference_data), 900)
            report.reference_s = time.monotonic() - started
            # The faulted job runs the same file; its requests are told apart on llm.requests by time.
            since = time.time()
            started = time.monotonic()
            job = await make_job(settings, reference_data)
            steps = [(0.15, "kill batch"), (0.35, "kill batch"), (0.5, "restart broker"), (0.65, "kill stages"),
                     (0.8, "kill batch")]
            for fraction, fault in steps:
                await wait_progress(settings, job, int(lines * fraction), 600)
                if fault == "restart broker":
                    report.faults.append(await services.restart_kafka())
                    continue
                victim = worker if fault == "kill batch" else stages
                killed_at = time.monotonic()
                victim.kill()
                _, before = await progress(settings, job)  # what the dead worker recorded: more is the successor's
                report.faults.append(f"SIGKILL {victim.name}")
                await asyncio.sleep(1.0)  # as `sluice run`'s supervisor restarts a child
                victim.start()
                if victim is worker:
                    await wait_progress(settings, job, before + 1, 120)
                    report.resume_s.append(time.monotonic() - killed_at)
            done = await wait_done(settings, job, 900)
            report.faulted_s = time.monotonic() - started
            if done.status is not Status.completed:
                report.problems.append(f"the faulted job ended {done.status.value}")
            ref, got = outcomes(settings, reference), outcomes(settings, done)
            report.output_lines = len(file_store(settings).path(file_store(settings).get(done.tenant, done.output_file_id))
                                      .read_bytes().splitlines()) if done.output_file_id else 0
            report.error_lines = got["__count__"] - report.output_lines  # type: ignore[operator]
            report.custom_ids_once = got["__count__"] == got["__ids__"] == lines
            keys = [f"line-{i:05d}" for i in range(lines)]
            report.bodies_identical = all(k in got and essence(got[k]) == essence(ref[k]) for k in keys)
            report.requests_sent = await count_requests(services.bootstrap, settings.kafka.partitions, since)
        finally:
            for p in procs:
                p.stop()
            await services.stop()
    if not report.custom_ids_once:
        report.problems.append("not exactly one line per custom_id")
    if not report.bodies_identical:
        report.problems.append("bodies differ from the undisturbed run")
    return report


@pytest.mark.chaos
@pytest.mark.slow
def test_a_10000_line_job_survives_three_kills_and_a_broker_restart() -> None:
    report = asyncio.run(run())
    print(report.markdown())
    assert report.problems == [], report.markdown()
    assert report.output_lines + report.error_lines == LINES and report.error_lines == 0
    assert all(s <= 15 for s in report.resume_s), report.resume_s
    assert report.requests_sent - LINES <= 4 * 32 + 64, report.markdown()  # at most what was in flight per fault


if __name__ == "__main__":
    lines = int(sys.argv[1]) if len(sys.argv) > 1 else LINES
    print(asyncio.run(run(lines)).markdown())

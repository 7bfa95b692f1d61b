"""One Kafka hop, aiokafka against faust-streaming and confluent-kafka: what a Kafka client costs sluice's runner per message.

    .venv/bin/python -m bench.kafka_hop                      # starts its own Kafka on 127.0.0.1:19192
    .venv/bin/python -m bench.kafka_hop --bootstrap 127.0.0.1:19092 --count 1000 --rate 200

Paths, measured one after another in one run on one broker, each on fresh topics:
  floor:           producer -> topic A -> measuring consumer (no stage);
  aiokafka*:       producer -> A -> stage (AIOKafkaConsumer + AIOKafkaProducer) -> B -> measuring consumer;
  faust*:          producer -> A -> stage (a faust-streaming agent) -> B -> measuring consumer;
  confluent*:      producer -> A -> stage (confluent-kafka, librdkafka in C, bridged to an asyncio
                   loop as a sluice runner on it would be) -> B -> measuring consumer.
The variants differ in commit policy and producer idempotence (STAGES). Each stage runs as its own
process (bench/kafka_hop_stages.py), as a sluice worker does. The producer and the measuring consumer
share this process, so a message's latency is one monotonic clock's difference: the send time travels
inside the 300-byte JSON payload. Nothing is subtracted. Per path: a warm-up (until the stage answers,
then `--warmup` more), `--count` messages at `--rate`/s for p50/p99 and the stage process's CPU time
per message at that rate (what a stage pays when each fetch brings one or two messages, as in sluice
below its knee), then `--blast` messages sent at once for throughput (first send to last arrival) and
the stage's CPU time per message in bulk. The
blast is bounded by the probe itself: the floor's throughput is that ceiling. One unreported floor
round first warms the broker (a cold JVM put ~100 ms into the first path's p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.kafka_hop_stages import FETCH_MAX_WAIT_MS, STAGES, producer
from bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD_BYTES = 300
FIRST_ANSWER_TIMEOUT_S = 60.0  # a faust worker needs some seconds to start and join its group
DRAIN_TIMEOUT_S = 30.0


FLOOR = "floor"  # no stage: the probe reads the topic it writes


@dataclass(frozen=True)
class Plan:
    bootstrap: str
    run_id: str
    partitions: int
    warmup: int
    count: int
    rate: float
    blast: int
    state: Path


@dataclass
class Result:
    path: str
    p50_ms: float
    p99_ms: float
    max_ms: float
    received: int
    sent: int
    throughput_msg_s: float
    stage_cpu_us_per_msg: float | None  # the stage process's CPU time during the blast, per message
    paced_cpu_us_per_msg: float | None = None  # the same during the paced phase (`--rate`)
    notes: list[str] = field(default_factory=list)


def payload(seq: int, phase: str) -> bytes:
    """A JSON message of exactly PAYLOAD_BYTES bytes carrying its send time (monotonic ns)."""
    body = {"seq": seq, "phase": phase, "t_ns": time.monotonic_ns(), "pad": ""}
    size = len(json.dumps(body, separators=(",", ":")).encode())
    body["pad"] = "x" * max(PAYLOAD_BYTES - size, 0)
    return json.dumps(body, separators=(",", ":")).encode()


class Probe:
    """Sends paced or blasted messages to one topic and times their arrival on another."""

    def __init__(self, bootstrap: str, send_topic: str, read_topic: str) -> None:
        self.send_topic = send_topic
        self.producer = producer(bootstrap, "hop-probe")
        self.consumer = AIOKafkaConsumer(
            read_topic,
            bootstrap_servers=bootstrap,
            client_id="hop-probe-reader",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # the topic is fresh: reading from its start misses nothing
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
        )
        self.seq = 0
        self.sent: dict[str, int] = {}
        self.first_send_ns: dict[str, int] = {}
        self.latency_ms: dict[str, dict[int, float]] = {}
        self.last_arrival_ns: dict[str, int] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        self._reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with suppress(asyncio.CancelledError):  # a reader that had failed raises its own error here
                await self._reader
        await self.consumer.stop()
        await self.producer.stop()

    async def _read(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=100)
            now = time.monotonic_ns()
            for records in batch.values():
                for record in records:
                    msg = json.loads(record.value)
                    self.latency_ms.setdefault(msg["phase"], {})[msg["seq"]] = (now - msg["t_ns"]) / 1e6
                    self.last_arrival_ns[msg["phase"]] = now

    def arrived(self, phase: str) -> int:
        return len(self.latency_ms.get(phase, {}))

    async def _send(self, phase: str) -> asyncio.Future[Any]:
        self.seq += 1
        self.sent[phase] = self.sent.get(phase, 0) + 1
        self.first_send_ns.setdefault(phase, time.monotonic_ns())
        return await self.producer.send(self.send_topic, payload(self.seq, phase))

    async def paced(self, phase: str, limit: int, rate: float, until: Callable[[], bool] | None = None) -> None:
        """Sends up to `limit` messages at `rate`/s (open loop); stops early once `until()` holds."""
        start = time.perf_counter()
        acks = []
        for i in range(limit):
            if until is not None and until():
                break
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            acks.append(await self._send(phase))
        await asyncio.gather(*acks)

    async def blast(self, phase: str, n: int) -> None:
        await asyncio.gather(*[await self._send(phase) for _ in range(n)])

    async def drain(self, phase: str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Waits until every message sent in `phase` has arrived, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while self.arrived(phase) < self.sent.get(phase, 0) and time.monotonic() < deadline:
            if self._reader is not None and self._reader.done():
                self._reader.result()  # raises what stopped the reader
                raise RuntimeError("the probe's reader stopped")
            await asyncio.sleep(0.02)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(probe: Probe, plan: Plan, path: str, stage: subprocess.Popen[bytes] | None) -> Result:
    stage_pid = stage.pid if stage is not None else None

    def stage_died() -> bool:
        return stage is not None and stage.poll() is not None

    ready_limit = int(plan.rate * FIRST_ANSWER_TIMEOUT_S)
    await probe.paced("ready", ready_limit, plan.rate, until=lambda: probe.arrived("ready") > 0 or stage_died())
    if stage_died():
        raise RuntimeError(f"{path}: the stage exited with {stage.returncode if stage else None}; see its log")
    if probe.arrived("ready") == 0:
        raise TimeoutError(f"{path}: nothing came back within {FIRST_ANSWER_TIMEOUT_S} s")
    await probe.paced("warm", plan.warmup, plan.rate)
    await probe.drain("warm")
    paced_before = cpu_seconds(stage_pid) if stage_pid is not None else 0.0
    await probe.paced("steady", plan.count, plan.rate)
    await probe.drain("steady")
    paced_used = cpu_seconds(stage_pid) - paced_before if stage_pid is not None else None
    cpu_before = cpu_seconds(stage_pid) if stage_pid is not None else 0.0
    await probe.blast("blast", plan.blast)
    await probe.drain("blast")
    cpu_used = cpu_seconds(stage_pid) - cpu_before if stage_pid is not None else None
    lat = list(probe.latency_ms.get("steady", {}).values())
    if not lat:
        raise TimeoutError(f"{path}: no steady-phase message came back")
    span_s = (probe.last_arrival_ns.get("blast", 0) - probe.first_send_ns["blast"]) / 1e9
    blast_in = probe.arrived("blast")
    result = Result(
        path=path,
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        max_ms=max(lat),
        received=len(lat),
        sent=probe.sent["steady"],
        throughput_msg_s=blast_in / span_s if span_s > 0 else 0.0,
        stage_cpu_us_per_msg=cpu_used / blast_in * 1e6 if cpu_used is not None and blast_in else None,
        paced_cpu_us_per_msg=paced_used / len(lat) * 1e6 if paced_used is not None else None,
    )
    if result.received < result.sent:
        result.notes.append(f"{result.sent - result.received} steady messages never arrived")
    if blast_in < plan.blast:
        result.notes.append(f"{plan.blast - blast_in} blast messages never arrived")
    return result


async def create_topics(bootstrap: str, names: list[str], partitions: int) -> None:
    """Creates the topics (auto-create is off) and returns once every partition has a leader."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="hop-admin")
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
        failed = [(topic, code, msg) for topic, code, msg in response.topic_errors if code != 0]
        if failed:
            raise RuntimeError(f"topic creation failed: {failed}")
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            described = await admin.describe_topics(names)
            if all(p["leader"] >= 0 for t in described for p in t["partitions"]) and len(described) == len(names):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no leader for every partition of {names} after 10 s")
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="hop-admin")
    await admin.start()
    try:
        await admin.delete_topics(names)
    finally:
        await admin.close()


def start_stage(plan: Plan, name: str, topic_in: str, topic_out: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bench.kafka_hop_stages", name, plan.bootstrap, topic_in, topic_out,
           f"hop-{name}-{plan.run_id}", str(plan.state)]
    with open(plan.state / f"stage-{name}.log", "wb") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def stop_stage(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run_path(plan: Plan, path: str, tag: str = "") -> Result:
    topic_a, topic_b = f"hop-{plan.run_id}-{path}{tag}-a", f"hop-{plan.run_id}-{path}{tag}-b"
    topics = [topic_a] if path == FLOOR else [topic_a, topic_b]
    await create_topics(plan.bootstrap, topics, plan.partitions)
    stage = None if path == FLOOR else start_stage(plan, path, topic_a, topic_b)
    probe = Probe(plan.bootstrap, topic_a, topics[-1])
    try:
        await probe.start()
        result = await measure(probe, plan, path, stage)
    finally:
        await probe.stop()
        if stage is not None:
            stop_stage(stage)
    if stage is not None and stage.returncode not in (0, -signal.SIGTERM):
        result.notes.append(f"stage exited with {stage.returncode}; see {plan.state}/stage-{path}.log")
    await delete_topics(plan.bootstrap, topics)
    return result


def table(results: list[Result]) -> str:
    lines = ["| path | library, settings | p50 ms | p99 ms | max ms | received/sent | throughput msg/s "
             "| stage CPU µs/msg paced | stage CPU µs/msg blast |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        label = STAGES[r.path].label if r.path in STAGES else "none: producer -> consumer"
        paced = f"{r.paced_cpu_us_per_msg:.0f}" if r.paced_cpu_us_per_msg is not None else "-"
        cpu = f"{r.stage_cpu_us_per_msg:.0f}" if r.stage_cpu_us_per_msg is not None else "-"
        lines.append(f"| {r.path} | {label} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.max_ms:.2f} "
                     f"| {r.received}/{r.sent} | {r.throughput_msg_s:.0f} | {paced} | {cpu} |")
    return "\n".join(lines)


async def bench(plan: Plan, paths: list[str]) -> list[Result]:
    """Measures each path in turn, after one unreported floor round that warms the broker's JIT."""
    await run_path(replace(plan, count=plan.warmup), FLOOR, tag="-broker-warmup")
    return [await run_path(plan, path) for path in paths]


def services(state: Path, action: str, kafka_port: int = 0, redis_port: int = 0) -> None:
    script = ROOT / "infra" / "services.sh"
    args = [str(script), action, str(state)] + ([str(kafka_port), str(redis_port)] if action == "start" else [])
    subprocess.run(args, cwd=ROOT, check=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", help="use this Kafka instead of starting one on 127.0.0.1:19192")
    p.add_argument("--paths", default=",".join([FLOOR, *STAGES]), help=f"comma-separated of: {FLOOR}, "
                   + ", ".join(STAGES))
    p.add_argument("--partitions", type=int, default=4, help="partitions per topic (sluice.toml uses 4)")
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--blast", type=int, default=5000)
    p.add_argument("--state-dir", type=Path, default=ROOT / ".state" / "bench-hop")
    return p.parse_args(argv)


def report(plan: Plan, command: str, results: list[Result], wall_s: float) -> None:
    data = {"command": command, "bootstrap": plan.bootstrap, "partitions": plan.partitions, "rate": plan.rate,
            "count": plan.count, "warmup": plan.warmup, "blast": plan.blast, "payload_bytes": PAYLOAD_BYTES,
            "wall_s": round(wall_s, 1), "results": [asdict(r) for r in results]}
    (plan.state / "kafka_hop.json").write_text(json.dumps(data, indent=2))
    print(f"\n`{command}`: {plan.count} messages at {plan.rate:.0f}/s after {plan.warmup} warm-up, then "
          f"{plan.blast} at once; {plan.partitions} partitions; {PAYLOAD_BYTES}-byte JSON; wall {wall_s:.0f} s\n")
    print(table(results))
    print("\nThroughput is bounded by the probe (one producer, one reader): the floor row is that ceiling, so a "
          "stage at or above it is not the bottleneck; its CPU µs/msg then tells the libraries apart.")
    for r in results:
        for note in r.notes:
            print(f"- {r.path}: {note}")
    print(f"\nJSON (also in {plan.state / 'kafka_hop.json'}):\n{json.dumps(data)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    state: Path = args.state_dir.resolve()
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - {FLOOR, *STAGES}
    if unknown:
        raise SystemExit(f"unknown paths: {sorted(unknown)}")
    own_kafka = args.bootstrap is None
    plan = Plan(args.bootstrap or "127.0.0.1:19192", f"{int(time.time())}-{time.monotonic_ns() % 10**6}",
                args.partitions, args.warmup, args.count, args.rate, args.blast, state)
    state.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python -m bench.kafka_hop", *(argv if argv is not None else sys.argv[1:])])
    started = time.monotonic()
    if own_kafka:
        services(state, "stop")  # a run that was killed may have left this state dir's services behind
        services(state, "start", 19192, 16279)
    try:
        results = asyncio.run(bench(plan, paths))
    finally:
        if own_kafka:
            services(state, "stop")
    report(plan, command, results, time.monotonic() - started)


if __name__ == "__main__":
    main()

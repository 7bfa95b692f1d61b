"""The chaos harness's machinery: its own Kafka and Redis, the config file, and the worker processes.

    Services     Kafka and Redis on their own ports (SLUICE_CHAOS_PORTS=K,R), state in .state/chaos-<K>;
                 either one restarts alone (TERM by pid, start again: the data dir survives)
    write_config the repository's sluice.toml with the instant backend and the chaos profile's stages
    (the worker processes and their supervisor are in supervisor.py)

Everything talks to 127.0.0.1 only; every wait has a timeout; every process is stopped by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
# A tree without `[profiles]` wires guard and postguard between the stages: they must run for anything to flow.
LEGACY = ("ingest", "guard", "route", "prefill", "decode", "postguard", "emit")


# Below Linux's ephemeral range (32768-60999): while a service is down, clients retrying a connection to a
# port inside it now and then connect to themselves (source port = destination port) and hold the port,
# so the restarted broker cannot bind it ("Address already in use"; seen at 39092 in a full run).
@dataclass(frozen=True)
class Ports:
    kafka: int
    redis: int

    @classmethod
    def from_env(cls) -> Ports:
        kafka, redis = (int(p) for p in os.environ.get("SLUICE_CHAOS_PORTS", "31092,31379").split(","))
        return cls(kafka, redis)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone: it holds no port)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def _stop_pid(pid_file: Path, timeout_s: float = 30.0) -> str:
    """TERM the process named in `pid_file`, wait for it to go, KILL it past `timeout_s`; says what it took."""
    if not pid_file.exists():
        return "not running"
    pid = int(pid_file.read_text().strip())
    started = time.monotonic()
    note = "not running"
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        while _alive(pid) and time.monotonic() - started < timeout_s:
            await asyncio.sleep(0.1)
        note = f"stopped in {time.monotonic() - started:.1f} s"
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            note = f"ignored TERM for {timeout_s:.0f} s: killed"
    pid_file.unlink(missing_ok=True)
    return note


class Services:
    """The chaos run's own broker and Redis."""

    def __init__(self, ports: Ports, state: Path) -> None:
        self.ports = ports
        self.state = state

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.ports.kafka}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports.redis}/0"

    async def start(self) -> None:
        busy = [p for p in (self.ports.kafka, self.ports.kafka + 1, self.ports.redis) if _listening(p)]
        if busy:
            raise RuntimeError(f"ports {busy} are in use: stop what listens there or set SLUICE_CHAOS_PORTS=K,R")
        self.state.mkdir(parents=True, exist_ok=True)
        await self.start_redis()
        await self.start_kafka()

    async def start_kafka(self) -> None:
        log = self.state / "kafka.log"
        if log.exists():  # start.sh truncates it: keep the previous broker's for a post-mortem
            log.rename(self.state / f"kafka.{time.strftime('%H%M%S')}.log")
        await _script("kafka", self.state, self.ports.kafka, timeout_s=120)

    async def start_redis(self) -> None:
        await _script("redis", self.state, self.ports.redis, timeout_s=30)

    async def stop_kafka(self) -> str:
        return await _stop_pid(self.state / "kafka.pid")

    async def stop_redis(self) -> str:
        return await _stop_pid(self.state / "redis.pid")

    async def restart_kafka(self, outage_s: float = 0.0) -> str:
        """Stop the broker, keep it down `outage_s`, start it on the same data; says how the stop went."""
        note = await self.stop_kafka()
        await asyncio.sleep(outage_s)
        await self.start_kafka()
        return f"kafka {note}"

    async def hang(self, service: str, seconds: float) -> str:
        """SIGSTOP `service` ("kafka" or "redis") for `seconds`, then SIGCONT: its sockets stay open and
        nothing answers, so clients learn of it only by their timeouts (a stop closes them at once)."""
        pid = int((self.state / f"{service}.pid").read_text().strip())
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"{service} {pid} stopped {seconds:.0f} s"

    async def restart_redis(self) -> str:
        note = await self.stop_redis()
        await self.start_redis()
        return f"redis {note}"

    async def stop(self) -> None:
        await self.stop_kafka()
        await self.stop_redis()


async def _script(service: str, state: Path, port: int, timeout_s: float) -> None:
    process = await asyncio.create_subprocess_exec(str(ROOT / "infra" / service / "start.sh"), str(state), str(port))
    try:
        code = await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise RuntimeError(f"{service} did not start within {timeout_s} s (see {state})") from None
    if code != 0:
        raise RuntimeError(f"{service} failed to start (exit {code}; see {state}/{service}.log)")


# --- the config file ------------------------------------------------------------------------------


def write_config(path: Path, services: Services, token_delay_ms: float, stages: tuple[str, ...], split: bool = True) -> Path:
    """The repository's sluice.toml with the instant backend (with `split`, prefill and decode; else one
    generate stage), 4 partitions and `stages` as its profile."""
    with (ROOT / "sluice.toml").open("rb") as f:
        raw: dict[str, Any] = tomllib.load(f)
    raw["profile"] = "chaos"
    raw["profiles"] = {**raw.get("profiles", {}), "chaos": list(stages)}
    raw["kafka"] = {**raw.get("kafka", {}), "bootstrap": services.bootstrap, "partitions": 4}
    raw["redis"] = {**raw.get("redis", {}), "url": services.redis_url}
    raw["backends"] = [{"name": "instant", "kind": "instant", "model": "instant", "pool": "instant", "token_delay_ms": token_delay_ms,
                        "split": split}]
    raw["runtime"] = {**raw.get("runtime", {}), "torch_threads": 1}
    # A profile with the cache runs its exact tier only: the semantic tier's embedder would add seconds of
    # loading to every restart of a whole process, and the chaos prompts repeat exactly or not at all.
    raw["cache"] = {**raw.get("cache", {}), "semantic": False}
    # Where guards must run (a tree without profiles), they pass everything: the prompts are not under test.
    raw["guard"] = {**raw.get("guard", {}), "injection_threshold": 1.0}
    text = "\n".join(_toml(raw)) + "\n"
    if tomllib.loads(text) != raw:
        raise AssertionError("the config writer lost something: compare with sluice.toml")
    path.write_text(text)
    return path


def _toml(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    def is_array_of_tables(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, dict) for i in v)

    lines = [f"{_key(k)} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict) and not is_array_of_tables(v)]
    for k, v in table.items():
        name = ".".join(_key(p) for p in (*prefix, k))
        if isinstance(v, dict):
            lines += ["", f"[{name}]", *_toml(v, (*prefix, k))]
        elif is_array_of_tables(v):
            for item in v:
                lines += ["", f"[[{name}]]", *_toml(item, (*prefix, k))]
    return lines


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")


def worker_env(config: Path, services: Services) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SLUICE_CONFIG=str(config),
        SLUICE_KAFKA_BOOTSTRAP=services.bootstrap,
        SLUICE_REDIS_URL=services.redis_url,
        SLUICE_PROFILE="chaos",
        PYTHONUNBUFFERED="1",
    )
    return env


def profile_stages(settings: object) -> tuple[str, ...]:
    """The stages to run: SLUICE_CHAOS_STAGES=a,b,c, else the config's profile, else the legacy chain."""
    if override := os.environ.get("SLUICE_CHAOS_STAGES"):
        return tuple(override.split(","))
    stages = getattr(settings, "stages", None)  # the active row of [profiles] (pipeline.topology)
    return tuple(stages) if stages else LEGACY


def decode_output(stages: tuple[str, ...], pools: tuple[str, ...]) -> str:
    """The topic decode writes its chunks to: llm.tokens ahead of postguard, else the next stage's input."""
    if "postguard" in stages:
        return "llm.tokens"
    from pipeline import topology  # the graph as data: without postguard, decode writes emit's input

    nodes = topology.graph(stages, pools)
    return next(n.topics.stream or "llm.tokens" for n in nodes if n.kind == "decode")


async def create_topics(env: dict[str, str], timeout_s: float = 120.0) -> None:
    """`sluice topics create` with the chaos config (the module form, so it runs this tree's code)."""
    process = await asyncio.create_subprocess_exec(
        str(PYTHON), "-m", "pipeline.cli", "topics", "create", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise RuntimeError(f"`sluice topics create` did not finish within {timeout_s} s") from None
    if process.returncode != 0:
        raise RuntimeError(f"`sluice topics create` failed: {out.decode(errors='replace')[-2000:]}")


async def joined(bootstrap: str, stages: Iterable[str]) -> dict[str, set[int]]:
    """The worker pids that are members of each stage's consumer group now, by stage kind ("decode" for
    `decode.<pool>`): a worker's client id is `sluice-<stage>-<pid>` (`pipeline.process`). Only the stages'
    groups, one per call: one call describing every group (the SDK's too) failed in aiokafka's decoder
    ("Buffer underrun decoding string"), and the cause was not looked into."""
    from aiokafka.admin import AIOKafkaAdminClient

    kinds = set(stages)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="chaos-harness")
    await admin.start()
    try:
        out: dict[str, set[int]] = {}
        for group, _ in await admin.list_consumer_groups():
            if group.split(".")[0] not in kinds:
                continue
            [description] = await admin.describe_consumer_groups([group])
            for _, _, _, _, _, members in description.groups:  # (error, id, state, type, protocol, members)
                for member in members:
                    if m := re.fullmatch(r"sluice-([a-z]+)(?:\.[\w.-]+)?-(\d+)", member[1]):
                        out.setdefault(m[1], set()).add(int(m[2]))
        return out
    finally:
        await admin.close()

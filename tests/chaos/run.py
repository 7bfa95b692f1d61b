"""Runs a chaos profile end to end and reports: `python -m tests.chaos.run --profile short --report out.json`.

    1. start the chaos run's own Kafka and Redis, write the config, create the topics
    2. start the workers (2 per stage) and wait until a probe request comes back
    3. run the scenarios in order: the fault-free reference, then each fault plan, with streaming
       requests in flight while the faults are injected by PID
    4. read every topic from the beginning, check each scenario, print the markdown report
    5. stop every worker and both services, whatever happened

Exit status: 0 when every invariant held, 1 when one was violated, 2 when the harness itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline import assemble
from pipeline import settings as settings_module
from pipeline.sdk import Client
from pipeline.settings import Settings
from tests.chaos import harness
from tests.chaos.checker import FaultEvent, ScenarioReport, Topics, check, markdown, read_topics
from tests.chaos.clients import ClientResult, NoAnswer, probe, run_load, stop_quietly
from tests.chaos.harness import Services
from tests.chaos.scenarios import PROFILES, WHOLE, Fault, Profile, Scenario
from tests.chaos.supervisor import Supervisor

JOIN_S = 90.0  # for every worker to join its group before a scenario
HEAVY = {"guard": 1, "postguard": 1}  # stages that load models: one worker each unless the profile faults them
FIRST_PROBE_S = 180.0
PROBE_S = 120.0


@dataclass
class Report:
    profile: str
    stages: list[str]
    seed: int
    wall_s: float
    scenarios: list[ScenarioReport]
    error: str | None = None  # the harness itself failed
    aborted: str | None = None  # the pipeline stopped answering: the scenarios after this were not run

    @property
    def ok(self) -> bool:
        return self.error is None and self.aborted is None and all(s.ok for s in self.scenarios)

    def markdown(self) -> str:
        return markdown(self.profile, self.stages, self.seed, self.wall_s, self.scenarios, self.error, self.aborted)


@dataclass
class _Run:
    scenario: Scenario
    results: list[ClientResult]
    faults: list[FaultEvent]
    window: tuple[float, float, float, float]


def say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextmanager
def _log_to(path: Path) -> Iterator[None]:
    """The harness's own log records (its Kafka clients' retries during faults) go to a file, not the console."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


async def run_profile(profile: Profile, seed: int | None = None) -> Report:
    seed = random.randrange(1 << 30) if seed is None else seed
    ports = harness.Ports.from_env()
    state = harness.ROOT / ".state" / f"chaos-{ports.kafka}"
    shutil.rmtree(state, ignore_errors=True)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # a TERMed run still stops its workers and services
    try:
        with _log_to(state / "harness.log"):
            report = await _run_profile(profile, seed, ports, state)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    if not report.ok:  # the next run clears `state`: keep the evidence
        kept = state.with_name(f"{state.name}-failed-{time.strftime('%Y%m%dT%H%M%S')}")
        shutil.copytree(state, kept, dirs_exist_ok=True)
        say(f"kept this failed run's state (topics' segments, Redis's append-only file, worker logs) in {kept}")
    return report


async def _run_profile(profile: Profile, seed: int, ports: harness.Ports, state: Path) -> Report:
    services = Services(ports, state)
    started = time.monotonic()
    supervisor: Supervisor | None = None
    stages: tuple[str, ...] = ()
    runs: list[_Run] = []
    aborted: str | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as tmp:
            say(f"profile {profile.name}: starting Kafka and Redis on {ports.kafka}, {ports.redis} (state in {state})")
            await services.start()
            config = harness.write_config(Path(tmp) / "sluice.toml", services, profile.token_delay_ms, profile.stages, profile.split)
            env = harness.worker_env(config, services)
            settings = settings_module.load(config, env)
            stages = harness.profile_stages(settings)
            await harness.create_topics(env)
            faulted = {fault.stage for scenario in profile.scenarios for fault in scenario.faults}
            wanted = {WHOLE: profile.workers_per_stage} if profile.whole else {
                s: profile.workers_per_stage if s in faulted else HEAVY.get(s, profile.workers_per_stage) for s in stages}
            supervisor = Supervisor(env, state / "logs", wanted, random.Random(seed))
            supervisor.start()
            say(f"started {sum(wanted.values())} workers: {wanted}; waiting for a first answer")
            async with _client(settings) as client:
                say(f"first answer after {await probe(client, FIRST_PROBE_S):.1f} s")
            nonce = uuid.uuid4().hex[:6]
            for scenario in profile.scenarios:
                try:
                    runs.append(await _run_scenario(scenario, profile, settings, supervisor, services, nonce))
                except NoAnswer as exc:  # what ran so far is still checked and reported
                    aborted = f"before scenario {scenario.name}: {exc}"
                    say(f"aborted {aborted}")
                    break
            pools = tuple(dict.fromkeys(b.pool for b in settings.backends))
            say("reading the topics")
            topics = await read_topics(services.bootstrap, "llm.responses.sdk", harness.decode_output(stages, pools))
            _dump(state, runs, topics)
            reports = _check_all(runs, topics, supervisor, stages)
        return Report(profile.name, list(stages), seed, round(time.monotonic() - started, 1), reports, aborted=aborted)
    except Exception:
        return Report(profile.name, list(stages), seed, round(time.monotonic() - started, 1), [], traceback.format_exc())
    finally:
        say("stopping workers and services")
        if supervisor is not None:
            await supervisor.stop()
        await services.stop()


def _dump(state: Path, runs: list[_Run], topics: Topics) -> None:
    """What the checker read, for a post-mortem: the clients' view and every topic record."""
    (state / "topics.json").write_text(json.dumps(asdict(topics)))
    clients = [{**r.as_dict(), "seqs": [seq for seq, _, _ in r.chunks], "text": r.text,
                "sent_at": r.sent_at, "arrivals": [at for _, _, at in r.chunks], "ended_at": r.ended_at}
               for run in runs for r in run.results]
    (state / "clients.json").write_text(json.dumps(clients))
    faults = [{**f.as_dict(), "scenario": run.scenario.name, "at": f.at, "ended": f.ended} for run in runs for f in run.faults]
    (state / "faults.json").write_text(json.dumps(faults))  # times: time.monotonic(), as in clients.json


def _check_all(runs: list[_Run], topics: Topics, supervisor: Supervisor, stages: Iterable[str]) -> list[ScenarioReport]:
    """`stages`: what a kill of `WHOLE` takes down (every stage the deployment runs)."""
    reference = {r.spec.key: r.text for r in runs[0].results if r.outcome == "done"}
    return [
        check(run.scenario.name, run.results, run.faults, topics, None if i == 0 else reference, supervisor.runs, run.window,
              whole=tuple(stages))
        for i, run in enumerate(runs)
    ]


async def _run_scenario(
    scenario: Scenario, profile: Profile, settings: Settings, supervisor: Supervisor, services: Services, nonce: str
) -> _Run:
    since, wall_since = time.monotonic(), time.time()
    try:
        await supervisor.wait_all_up(60)
        await _wait_joined(supervisor, services.bootstrap, JOIN_S, _kinds(settings))
    except TimeoutError as exc:  # workers crash as fast as they are restarted, or never join their group
        raise NoAnswer(str(exc)) from None
    async with _client(settings) as client:
        await probe(client, PROBE_S)
        family = profile.family(scenario.family)
        specs = [family[j % len(family)] for j in range(scenario.requests)]
        say(f"scenario {scenario.name}: {scenario.requests} requests, {len(scenario.faults)} faults")
        t0 = time.monotonic()
        injected = [asyncio.create_task(_inject(fault, t0, supervisor, services)) for fault in scenario.faults]
        try:
            results = await run_load(client, scenario.name, specs, scenario.rate, nonce, profile.repeat_after)
        finally:
            faults = list(await asyncio.gather(*injected))
    return _Run(scenario, results, faults, (since, time.monotonic(), wall_since, time.time()))


def _kinds(settings: Settings) -> tuple[str, ...]:
    """The stage kinds the deployment runs (generate where the pool does not split)."""
    return tuple(dict.fromkeys(node.kind for node in assemble.nodes_of(settings)))


async def _wait_joined(supervisor: Supervisor, bootstrap: str, timeout_s: float, kinds: tuple[str, ...]) -> None:
    """Until every live worker is a member of its stage's consumer group (a worker of every stage,
    `WHOLE`: of every one of `kinds`): a restarted guard loads its models for 10-15 s before it joins,
    and a fault aimed at it meanwhile would hit no partition."""
    def groups(stage: str) -> tuple[str, ...]:
        return kinds if stage == WHOLE else (stage,)

    deadline = time.monotonic() + timeout_s
    while True:
        live = supervisor.live_pids()
        members = await harness.joined(bootstrap, {k for stage in live for k in groups(stage)})
        waiting = {stage: {p for p in pids if any(p not in members.get(k, set()) for k in groups(stage))} for stage, pids in live.items()}
        if not any(waiting.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not in their consumer groups after {timeout_s} s: {waiting}")
        await asyncio.sleep(0.5)


async def _inject(fault: Fault, t0: float, supervisor: Supervisor, services: Services) -> FaultEvent:
    await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
    at, pid, note = time.monotonic(), None, ""
    stage = fault.stage or ""
    say(f"fault: {fault.kind} {stage}".rstrip())
    try:
        match fault.kind:
            case "kill":
                pid = (await supervisor.kill(stage)).pid
            case "pause":
                pid = (await supervisor.pause(stage, fault.seconds)).pid
            case "add":
                pid = supervisor.add(stage).pid
            case "remove":
                pid = (await supervisor.remove(stage)).pid
            case "broker_restart":
                note = await services.restart_kafka()
            case "broker_outage":
                note = await services.restart_kafka(outage_s=fault.seconds)
            case "redis_restart":
                note = await services.restart_redis()
            case "broker_hang":
                note = await services.hang("kafka", fault.seconds)
            case "redis_hang":
                note = await services.hang("redis", fault.seconds)
    except Exception as exc:  # reported as a harness failure of this scenario; the run goes on
        say(f"fault {fault.kind} {stage} failed: {exc}")
        return FaultEvent(fault.kind, fault.stage, pid, at, time.monotonic(), note, f"{type(exc).__name__}: {exc}")
    return FaultEvent(fault.kind, fault.stage, pid, at, time.monotonic(), note)


@asynccontextmanager
async def _client(settings: Settings) -> AsyncIterator[Client]:
    client = Client(settings, model="instant")
    await client.start()
    try:
        yield client
    finally:
        await stop_quietly(client.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description="sluice's chaos suite")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--report", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument("--seed", type=int, default=None, help="which workers the faults pick")
    parser.add_argument("--only", default=None, help="run only these scenarios (comma-separated) after the reference")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if args.only is not None:
        wanted = {"reference", *args.only.split(",")}
        if unknown := wanted - {s.name for s in profile.scenarios}:
            parser.error(f"no such scenario in {profile.name}: {', '.join(sorted(unknown))}")
        profile = replace(profile, scenarios=tuple(s for s in profile.scenarios if s.name in wanted))
    report = asyncio.run(run_profile(profile, args.seed))
    print(report.markdown())
    if args.report is not None:
        args.report.write_text(json.dumps(asdict(report), indent=2, default=str))
    if report.error is not None:
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

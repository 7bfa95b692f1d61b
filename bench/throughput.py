"""Throughput through the bridge: open-loop HTTP load at increasing rates, non-streaming, 16 tokens,
against sluice (`sluice run`, as a user starts it) and LiteLLM (pinned, one worker, its own virtual
environment) in front of the same fake OpenAI-compatible upstream, interleaved in one run.

    .venv/bin/python -m bench.throughput                                 # the default table
    .venv/bin/python -m bench.throughput --rates 100,300,500 --repeats 3 --systems sluice-instant
    .venv/bin/python -m bench.throughput --guards --systems sluice-instant --rates 20,50,100
        (the guard and postguard stages each in a process of its own: their CPU per request is reported apart;
        a before-* system laid out so too when its commit has `sluice bridge`, else in one `sluice run`)

Systems:
    direct          the fake upstream itself (what every proxy adds its overhead to)
    litellm         LiteLLM 1.108.7 proxy, one worker, model routed to the fake upstream
    sluice-openai   sluice with an `openai` backend on the same fake upstream (ingest, cache, route, generate, emit)
    sluice-instant  sluice with its in-process instant backend (the transport topology, no upstream hop)
    sluice-instant:N   the same with `bridge.max_in_flight = N` (admission control: over N open requests, a 503)
    sluice-instant@L   the same with its producers' `kafka.linger_ms = L` (else --linger-ms); both: @L:N
    sluice-instant+first   the same with `[run] bridges = "first"`: the bridge in the first process only
    sluice-openai+whole   `stream_upstream = false`: the upstream asked for one whole answer, as LiteLLM asks it,
                    when the client does not stream (these requests), instead of a stream
    sluice-instant+pyredis   the same with redis-py's pure-Python reply parser: hiredis (which `make setup`
                    installs) shadowed by a module that fails to import, in every process of that system
    before-instant, before-openai   the same, from the commit --before (a git worktree under .cache/bench):
                    the figures before this benchmark's changes, measured in the same run
    any of them#LABEL   a label tells two systems of one kind apart; `--redis-set LABEL:NAME=VALUE` sets NAME
                    on that system's Redis (CONFIG SET) when it starts, so Redis settings compare side by side:
                    --systems "sluice-instant,sluice-instant#aof400" --redis-set aof400:auto-aof-rewrite-percentage=400

For every system, rate and repeat: requests sent and answered 200, errors, served/s (answers over the
time from the first send to the last answer), latency p50/p99, and CPU milliseconds per served
request of every process involved (sluice's processes, the broker, Redis, the upstream, LiteLLM, the
load generator itself), and the seconds of the step during which the system's Redis was rewriting its
append-only file (its log says when: a forked child writes the whole dataset, on the same cores).
Results also go to --out as JSON. Each sluice system has a Kafka and a Redis of its own (ports from
19392/16679 up, in steps of 100); before session 12 they shared one, so the stages of all the systems
up in a run formed one consumer group per stage and served each other's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from bench.http_load import Pool, paced_posts
from bench.services import ROOT, own_services
from bench.stats import percentile

LITELLM = "1.108.7"
LITELLM_VENV = ROOT / ".cache" / "bench" / f"litellm-{LITELLM}"
KAFKA_PORT, REDIS_PORT = 19392, 16679
UPSTREAM_PORT, SLUICE_PORT, LITELLM_PORT = 19401, 19410, 19405  # Kafka takes its port + 1 (controller)
MODEL = "fake-model"
LITELLM_KEY = "sk-bench-" + uuid.uuid4().hex
PATH = "/v1/chat/completions"


@dataclass
class Result:
    system: str
    rate: float
    repeat: int
    sent: int
    ok: int
    errors: dict[str, int]
    served_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    # each process of a group of several (sluice's: the supervisor, `run --in-process` with the bridge,
    # each `worker`), by group and the process's arguments after `pipeline.cli`
    cpu_ms_per_process: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0  # when the step began (epoch seconds), to lay beside the services' logs
    seconds: float = 0.0  # how long it took, from the first send to the last answer
    # seconds of the step during which the system's Redis was rewriting its append-only file (a forked
    # child writing the whole dataset: on two cores it competes with everything else); from its log
    redis_rewriting_s: float = 0.0


def sluice_config(backend: str, guards: bool, processes: int, linger_ms: int, max_in_flight: int = 0) -> str:
    stages = '["ingest", "guard", "cache", "route", "prefill", "decode", "postguard", "emit"]' if guards else \
        '["ingest", "cache", "route", "prefill", "decode", "emit"]'
    if backend == "openai":
        backend_table = f'kind = "openai"\nbase_url = "http://127.0.0.1:{UPSTREAM_PORT}/v1"\nsplit = false'
    else:
        backend_table = 'kind = "instant"\nsplit = false'
    return f"""
profile = "bench"
replies = ["bridge", "sdk"]
[profiles]
bench = {stages}
[kafka]
bootstrap = "127.0.0.1:{KAFKA_PORT}"
linger_ms = {linger_ms}
[redis]
url = "redis://127.0.0.1:{REDIS_PORT}/0"
[bridge]
port = {SLUICE_PORT}
max_in_flight = {max_in_flight}
[run]
processes = {processes}
[[backends]]
name = "upstream"
model = "{MODEL}"
pool = "upstream"
max_batch = 256
{backend_table}
[cache]
semantic = false
[gateway]
auth_required = false
"""


LITELLM_CONFIG = f"""
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{UPSTREAM_PORT}/v1
      api_key: fake
litellm_settings:
  drop_params: true
"""


def unlabelled(system: str) -> str:
    """`sluice-instant#aof400` -> `sluice-instant`: a label only tells two systems of one kind apart (and
    picks the `--redis-set` settings of its Redis)."""
    return system.partition("#")[0]


PY_REDIS = "+pyredis"
FIRST_BRIDGE = "+first"  # `[run] bridges = "first"`: the bridge in the first process only
WHOLE = "+whole"  # openai: `stream_upstream = false`, a request the client does not stream asked whole


def no_hiredis() -> Path:
    """A directory whose `hiredis` fails to import: first on PYTHONPATH, redis-py falls back to its Python parser."""
    path = ROOT / ".cache" / "bench" / "no-hiredis" / "hiredis"
    path.mkdir(parents=True, exist_ok=True)
    (path / "__init__.py").write_text('raise ImportError("hiredis shadowed by bench.throughput (+pyredis)")\n')
    return path.parent


def litellm_venv() -> Path:
    """LiteLLM in a virtual environment of its own (its pins clash with sluice's), created once."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([LITELLM_VENV / "bin" / "pip", "install", "-q", f"litellm[proxy]=={LITELLM}"], check=True)
    return binary


def before_tree(rev: str) -> Path:
    """sluice as it was at `rev`, checked out once under .cache/bench (its code runs on this .venv)."""
    tree = ROOT / ".cache" / "bench" / f"sluice-{rev}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True, capture_output=True)
    return tree


# Config lines the benchmark writes that older commits do not know, each with the field whose presence
# in that commit's pipeline/settings.py says it does (an older instant backend always splits).
_NEWER_KEYS = {"split = ": "split:", "linger_ms = ": "linger_ms:", "[run]": "class RunSettings",
               "processes = ": "class RunSettings", "bridges = ": "bridges:", "max_in_flight = ": "bridge.max_in_flight"}


def splits(tree: Path) -> bool:
    """Whether the code in `tree` can run its bridge apart from its stages (`sluice bridge`)."""
    return '"bridge"' in (tree / "pipeline" / "cli.py").read_text()


def before_config(config: str, tree: Path) -> str:
    """The config without the keys the code in `tree` does not know, and only those: dropping one a commit
    knows changes what it runs (without `split = false` the instant backend splits: a hop more)."""
    known = (tree / "pipeline" / "settings.py").read_text()
    dropped = tuple(line for line, field in _NEWER_KEYS.items() if field not in known)
    return "\n".join(line for line in config.splitlines() if not line.startswith(dropped))


class Started:
    """A server process of the benchmark, its process tree measured for CPU."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, cwd: Path = ROOT) -> None:
        self.name, self.port = name, port
        self.log = open(ROOT / ".state" / f"bench-throughput-{name}.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        """SIGTERM, then after 30 s SIGKILL to the whole tree: `sluice run` waits up to 30 s for its
        children, and killing it alone would leave them holding the ports the next system needs."""
        try:
            tree = self.tree()
        except psutil.NoSuchProcess:  # it has exited already
            tree = []
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            for process in tree:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            self.process.wait()
        self.log.close()


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def settle(percent: float, most_s: float = 180.0) -> None:
    """Waits until the whole machine's CPU is under `percent` (of all cores) for a second, at most
    `most_s`: a system left past its knee (LiteLLM goes on with requests its clients gave up on) must not
    run into the next system's step."""
    if percent <= 0:
        return
    started = time.monotonic()
    while (busy := await asyncio.to_thread(psutil.cpu_percent, 1.0)) >= percent and time.monotonic() - started < most_s:
        pass
    waited = time.monotonic() - started
    if busy >= percent:
        print(f"did not settle in {waited:.0f} s after the pause (machine {busy:.0f}% busy)", flush=True)
    elif waited > 1.5:
        print(f"settled {waited:.0f} s after the pause (machine {busy:.0f}% busy)", flush=True)


def rewriting_during(log: Path, start: float, seconds: float) -> float:
    """Seconds of [start, start + seconds] during which Redis (by its log) was rewriting its AOF."""
    spans, began = [], None
    for line in log.read_text(errors="replace").splitlines():
        if "Starting automatic rewriting of AOF" in line or "Background AOF rewrite terminated" in line:
            at = datetime.strptime(" ".join(line.split()[1:5]), "%d %b %Y %H:%M:%S.%f").timestamp()
            if "Starting" in line:
                began = at
            elif began is not None:
                spans.append((began, at))
                began = None
    if began is not None:
        spans.append((began, start + seconds))
    return round(sum(max(0.0, min(end, start + seconds) - max(begin, start)) for begin, end in spans), 2)


def role(process: psutil.Process) -> str:
    """A process's arguments after `pipeline.cli` (`run --in-process`, `worker`), else its name."""
    try:
        argv = process.cmdline()
    except psutil.NoSuchProcess:
        return "gone"
    return " ".join(argv[argv.index("pipeline.cli") + 1:]) if "pipeline.cli" in argv else process.name()


def body(i: int, max_tokens: int) -> bytes:
    prompt = f"Request {uuid.uuid4().hex[:12]}: tell me something about the number {i}."  # unique: no cache hits
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}).encode()


async def wait_port(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.3)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


async def wait_ready(port: int, path: str, payload: bytes, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    pool = Pool("127.0.0.1", port, {"Authorization": f"Bearer {LITELLM_KEY}"})
    try:
        while time.monotonic() < deadline:
            try:
                status, _ = await asyncio.wait_for(pool.post(path, payload), 10)
                if status == 200:
                    return
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                pool = Pool("127.0.0.1", port, {"Authorization": f"Bearer {LITELLM_KEY}"})
            await asyncio.sleep(0.5)
    finally:
        pool.close()
    raise TimeoutError(f"nothing answered 200 on port {port} within {timeout_s} s")


async def load(system: str, port: int, rate: float, seconds: float, max_tokens: int, groups: dict[str, list[psutil.Process]],
               repeat: int) -> Result:
    n = max(1, int(rate * seconds))
    bodies = [body(i, max_tokens) for i in range(n)]
    pool = Pool("127.0.0.1", port, {"Authorization": f"Bearer {LITELLM_KEY}"})  # only LiteLLM checks it
    before = {g: cpu_seconds(ps) for g, ps in groups.items()}
    several = {f"{g}:{role(p)}:{p.pid}": p for g, ps in groups.items() if len(ps) > 1 for p in ps}
    before_each = {name: cpu_seconds([p]) for name, p in several.items()}
    started, started_at = time.perf_counter(), time.time()
    outcomes = await paced_posts(pool, PATH, bodies, rate)
    elapsed = time.perf_counter() - started
    after = {g: cpu_seconds(ps) for g, ps in groups.items()}
    after_each = {name: cpu_seconds([p]) for name, p in several.items()}
    pool.close()
    ok = [o for o in outcomes if o.status == 200]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            kind = str(o.status) if o.status else f"no_answer:{o.error}"
            errors[kind] = errors.get(kind, 0) + 1
    lat = [o.latency_ms for o in ok] or [float("nan")]
    cpu = {g: round((after[g] - before[g]) * 1000 / max(len(ok), 1), 3) for g in groups}
    each = {name: round((after_each[name] - before_each[name]) * 1000 / max(len(ok), 1), 3) for name in several}
    return Result(system, rate, repeat, n, len(ok), errors, round(len(ok) / elapsed, 1), round(percentile(lat, 50), 2),
                  round(percentile(lat, 99), 2), cpu, each, round(started_at, 3), round(elapsed, 2))


def print_table(results: list[Result]) -> None:
    print("\n| system | offered/s | repeat | served/s | ok/sent | errors | p50 ms | p99 ms | CPU ms/request by process | Redis AOF rewrite s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(results, key=lambda r: (r.system, r.rate, r.repeat)):
        cpu = ", ".join(f"{g} {v:.2f}" for g, v in r.cpu_ms_per_request.items() if v > 0.005)
        errs = ", ".join(f"{k}:{v}" for k, v in r.errors.items()) or "0"
        print(f"| {r.system} | {r.rate:g} | {r.repeat} | {r.served_per_s:.1f} | {r.ok}/{r.sent} | {errs} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {cpu} | {r.redis_rewriting_s:g} |")


async def run(args: argparse.Namespace) -> None:
    systems = args.systems.split(",")
    redis_settings: dict[str, list[str]] = {}
    for item in args.redis_set:
        label, _, setting = item.partition(":")
        redis_settings.setdefault(label, []).append(setting)
    rates = [float(r) for r in args.rates.split(",")]
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        # Each sluice system gets a Kafka and a Redis of its own: on shared ones, the systems' stages (same
        # topics, same consumer groups) would share each other's load, and their CPU would not be their own.
        service_envs: dict[str, dict[str, str]] = {}
        infra: dict[str, dict[str, list[psutil.Process]]] = {}
        redis_logs: dict[str, Path] = {}
        for i, system in enumerate(s for s in systems if s.startswith(("sluice-", "before-"))):
            name = f"bench-throughput-{i}"
            redis_port = REDIS_PORT + 100 * i
            service_envs[system] = stack.enter_context(own_services(name, KAFKA_PORT + 100 * i, redis_port))
            state = ROOT / ".state" / name
            redis_logs[system] = state / "redis.log"
            infra[system] = {"kafka": [psutil.Process(int((state / "kafka.pid").read_text()))],
                             "redis": [psutil.Process(int((state / "redis.pid").read_text()))]}
            for setting in redis_settings.get(system.partition("#")[2], []):
                name, _, value = setting.partition("=")
                subprocess.run(["redis-cli", "-p", str(redis_port), "CONFIG", "SET", name, value], check=True,
                               stdout=subprocess.DEVNULL)
        servers: dict[str, Started] = {}
        parts: dict[str, dict[str, Started]] = {}  # --guards: a system's worker processes by role
        upstream = Started("upstream", [sys.executable, "-m", "bench.fake_openai", "--port", str(UPSTREAM_PORT)], {}, UPSTREAM_PORT)
        servers["upstream"] = upstream
        ports = {"direct": UPSTREAM_PORT}
        configs = tempfile.mkdtemp(prefix="bench-throughput-")
        try:
            for system in systems:
                if system.startswith(("sluice-", "before-")):
                    port = SLUICE_PORT + 10 * len(servers)
                    path = Path(configs) / f"{system}.toml"
                    kind = unlabelled(system)
                    variant, _, bound = kind.split("-", 1)[1].removesuffix(PY_REDIS).removesuffix(FIRST_BRIDGE).removesuffix(WHOLE).partition(":")
                    backend, _, linger = variant.partition("@")
                    config = sluice_config(backend, args.guards, args.processes, int(linger or args.linger_ms), int(bound or 0))
                    config = config.replace(f"port = {SLUICE_PORT}", f"port = {port}")
                    if FIRST_BRIDGE in kind:
                        config = config.replace("[run]", '[run]\nbridges = "first"')
                    if WHOLE in kind:
                        if backend != "openai":
                            raise SystemExit(f"{system}: {WHOLE} is for an openai system")
                        config = config.replace('kind = "openai"', 'kind = "openai"\nstream_upstream = false')
                    service_env = service_envs[system]
                    config = config.replace(f"127.0.0.1:{KAFKA_PORT}", service_env["SLUICE_KAFKA_BOOTSTRAP"])
                    config = config.replace(f"redis://127.0.0.1:{REDIS_PORT}/0", service_env["SLUICE_REDIS_URL"])
                    before = system.startswith("before-")
                    cwd = before_tree(args.before) if before else ROOT
                    path.write_text(before_config(config, cwd) if before else config)
                    env = {**service_env, "SLUICE_CONFIG": str(path)}
                    if kind.endswith(PY_REDIS):  # every process of it (the supervisor's too) finds no hiredis
                        env["PYTHONPATH"] = os.pathsep.join([str(no_hiredis()), str(ROOT)])
                    ports[system] = port
                    if not args.guards or not splits(cwd):
                        if args.guards:
                            print(f"note: {system} has no `sluice bridge`; its guards share the process of the other "
                                  "stages, so it is not laid out like sluice-* and its CPU per guard is not its own")
                        servers[system] = Started(system, [sys.executable, "-m", "pipeline.cli", "run"], env, port, cwd)
                        continue
                    # With the guards, each guard in a process of its own, so its CPU per request is its own.
                    servers[system] = Started(system, [sys.executable, "-m", "pipeline.cli", "bridge"], env, port, cwd)
                    await wait_port(port)  # the bridge has created the topics the workers subscribe to
                    for part, stages in (("stages", ["ingest", "cache", "route", "generate", "emit"]),
                                         ("guard", ["guard"]), ("postguard", ["postguard"])):
                        argv = [sys.executable, "-m", "pipeline.cli", "worker", *stages]
                        parts.setdefault(system, {})[part] = Started(f"{system}-{part}", argv, env, port, cwd)
                elif system == "litellm":
                    path = Path(configs) / "litellm.yaml"
                    path.write_text(LITELLM_CONFIG)
                    argv = [str(litellm_venv()), "--config", str(path), "--port", str(LITELLM_PORT), "--num_workers", "1"]
                    # It refuses to start without a master key; checking one costs it a string comparison.
                    servers[system] = Started(system, argv, {"LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": LITELLM_KEY}, LITELLM_PORT)
                    ports[system] = LITELLM_PORT
            for system in systems:
                await wait_ready(ports[system], PATH, body(0, args.max_tokens))
                # Warm up, the broker's JIT too: its C2 compiler was still taking ~1 ms of CPU per request
                # after 50 s of load, and the 6 s this used to be doubled the broker's figure at 50/s.
                await load(system, ports[system], args.warmup_rate, args.warmup_s, args.max_tokens, {}, -1)
            for system in systems:  # what each process spends with no load at all (heartbeats, polls, commits)
                if system != "direct":
                    groups = {**infra.get(system, {}), system: servers[system].tree()}
                    groups |= {f"{system}:{part}": started.tree() for part, started in parts.get(system, {}).items()}
                    before = {g: cpu_seconds(ps) for g, ps in groups.items()}
                    await asyncio.sleep(args.idle_s)
                    idle = {g: round((cpu_seconds(ps) - before[g]) * 100 / args.idle_s, 1) for g, ps in groups.items()}
                    print(f"idle CPU % of a core with {system} up: {idle}", flush=True)
            for repeat in range(args.repeats):
                for rate in rates:
                    order = systems if repeat % 2 == 0 else list(reversed(systems))
                    for system in order:
                        groups = {**infra.get(system, {}), "upstream": upstream.tree(), "loadgen": [psutil.Process()]}
                        if system != "direct":
                            groups[system if system not in parts else f"{system}:bridge"] = servers[system].tree()
                        for part, started in parts.get(system, {}).items():
                            groups[f"{system}:{part}"] = started.tree()
                        result = await load(system, ports[system], rate, args.seconds, args.max_tokens, groups, repeat)
                        if system in redis_logs:
                            result.redis_rewriting_s = rewriting_during(redis_logs[system], result.started_at, result.seconds)
                        results.append(result)
                        print(json.dumps(asdict(result)), flush=True)
                        await asyncio.sleep(args.pause)
                        await settle(args.settle_percent)
        finally:
            for server in [*servers.values(), *(p for by_role in parts.values() for p in by_role.values())]:
                server.stop()
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="direct,litellm,sluice-instant,sluice-openai")
    parser.add_argument("--rates", default="20,50,100,200,400,600")
    parser.add_argument("--seconds", type=float, default=8.0, help="load per step")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between steps (backlogs drain)")
    parser.add_argument("--settle-percent", type=float, default=25.0,
                        help="after the pause, wait (up to 180 s) until the machine's CPU is under this %% of all cores; 0: do not")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--processes", type=int, default=0, help="sluice run's processes (0: one per core)")
    parser.add_argument("--guards", action="store_true", help="sluice with its guard and postguard stages")
    parser.add_argument("--before", default="7c2a0d9", help="the commit the before-* systems run")
    parser.add_argument("--linger-ms", type=int, default=0, help="sluice's producers' linger (kafka.linger_ms)")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="seconds of load per system before the steps")
    parser.add_argument("--warmup-rate", type=float, default=60.0, help="requests per second of the warm-up")
    parser.add_argument("--idle-s", type=float, default=5.0, help="seconds of no load, to measure what idling costs")
    parser.add_argument("--out", default="", help="write every result here as JSON")
    parser.add_argument("--redis-set", action="append", default=[], metavar="LABEL:NAME=VALUE",
                        help="CONFIG SET on the Redis of the systems named with #LABEL (sluice-instant#LABEL), "
                             "e.g. aof400:auto-aof-rewrite-percentage=400; repeatable")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

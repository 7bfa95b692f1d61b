"""One typed settings object, built once from the config file and the environment, passed explicitly.

Nothing else in sluice reads environment variables.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import msgspec

from pipeline.batch.config import BatchSettings
from pipeline.cache.config import CacheSettings
from pipeline.gateway.config import GatewaySettings
from pipeline.guard.config import GuardSettings
from pipeline.observability.config import ObservabilitySettings
from pipeline.routing.config import RoutingSettings
from pipeline.strict import describe, mask_url, unknown_keys
from pipeline.topology import check_profile
from topics.registry import reply_topic, routed_topic

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "sluice.toml"


class SettingsError(ValueError):
    """The config file or an environment variable holds a value sluice cannot use."""


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = "127.0.0.1:19092"
    partitions: int = 4
    # A dead worker's partitions move to a live one after the session timeout (the broker's
    # group.min.session.timeout.ms must allow it; infra/kafka sets 1 s).
    session_timeout_ms: int = 3000
    heartbeat_interval_ms: int = 500
    # How long a producer waits for more messages to send in the same request. 0: at once (each hop adds
    # nothing); under load messages batch anyway while a request is in flight (bench/throughput.py).
    linger_ms: int = 0
    # Records no request waits for (`registry.LINGERING`: usage records, cache entries) go through a
    # second producer of the process that waits this long to batch them: a produce request per usage
    # record was about a tenth of sluice's CPU per request at 400/s (docs/benchmarks.md, "Session 35").
    # 0: the one producer.
    lingering_ms: int = 20


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:16379/0"  # a password in it (redis://user:pw@host) is used, and masked
    # An ACL user (the secure profile's `sluice`) and its password: from SLUICE_REDIS_USER and
    # SLUICE_REDIS_PASSWORD (infra/run.sh reads it from the mode-600 file), never from an argument.
    username: str = ""
    password: str = field(default="", repr=False)

    def __repr__(self) -> str:  # the dataclass's, with the url's password masked as the field above is left out
        return f"RedisSettings(url={mask_url(self.url)!r}, username={self.username!r})"


# A request crosses every hop as one Kafka record, and the broker's and producer's record limit is 1 MiB by
# default: a prompt past half of it (the rest for the request's other fields and envelope) could be
# accepted by the bridge and then never be produced.
MAX_PROMPT_BYTES = 512 * 1024


@dataclass(frozen=True)
class LimitSettings:
    max_prompt_bytes: int = 32768
    max_messages: int = 64
    max_tokens_cap: int = 1024
    # The longest deadline a request may ask for: every wait that lasts "until the deadline" (a retry
    # through an outage, a terminal event held for a late chunk) is bounded by it.
    max_deadline_s: float = 3600.0


@dataclass(frozen=True)
class BridgeSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    reply_name: str = "bridge"
    header_timeout_s: float = 10.0  # a connection whose request head is not complete by then is closed
    body_timeout_s: float = 30.0  # a request body not read by then is refused with 408
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this many seconds
    # Requests one bridge process holds open at once (HTTP and WebSocket); past it a new one is answered
    # 503 with Retry-After before it reaches Kafka (bridge/admission.py). 0: no bound.
    max_in_flight: int = 0
    # Requests one WebSocket may have running at once (HTTP/2's MAX_CONCURRENT_STREAMS); a message past it is
    # refused on the socket with `rate_limited`, before it reaches Kafka (bridge/websocket.py)
    ws_max_requests: int = 32
    # A write to a client that stays blocked this long (the client reads nothing: the connection's buffer
    # stays full) ends the connection, and so the response and its requests (nginx's send_timeout; bridge/edges.py)
    send_timeout_s: float = 60.0
    ws_idle_s: float = 300.0  # a WebSocket with no request running for this long is closed (code 1000)
    # /metrics on the API port: empty serves it openly unless gateway.auth_required (then not at all);
    # set (SLUICE_METRICS_TOKEN), it needs `Authorization: Bearer <token>`.
    metrics_token: str = field(default="", repr=False)


@dataclass(frozen=True)
class BackendSettings:
    name: str
    model: str  # the model name clients ask for
    pool: str  # consumers of llm.routed.<pool> serve this backend
    # local: sluice's engine in this process; instant: numbered tokens, no model (chaos tests, benchmarks);
    # triton: a Triton Inference Server model over gRPC; openai: any OpenAI-compatible server (vLLM, SGLang, TGI...)
    kind: Literal["local", "instant", "triton", "openai"] = "local"
    max_batch: int = 16
    token_delay_ms: float = 0.0  # instant backend only: time per generated token
    url: str = ""  # triton: the server's gRPC address, host:port (from this file only, never from a request)
    triton_model: str = ""  # triton: the model's name in the repository (sluice_llm, ensemble, tensorrt_llm_bls)
    base_url: str = ""  # openai: e.g. http://127.0.0.1:8000/v1 (from this file only, never from a request)
    upstream_model: str = ""  # openai: the model name the upstream server knows (default: `model`)
    api_key_env: str = ""  # openai: the NAME of the environment variable holding the upstream key (never the key)
    timeout_s: float = 60.0  # triton, openai: connect (a pooled connection's wait included) and per-chunk read timeout; openai: the request's write and the answer's headers within 2x this
    # openai: false asks the upstream for one whole answer when the client does not stream (one JSON body:
    # about half the upstream's CPU per request for short answers, docs/benchmarks.md); timeout_s then bounds
    # the whole generation, since vLLM sends nothing of such an answer until all of it is generated
    stream_upstream: bool = True
    # local, instant: false serves the pool with one generation stage instead of prefill + decode (one hop
    # less, no KV handoff between processes); triton and openai backends never split
    split: bool | None = None
    # local: where prefill leaves each prefilled sequence's KV for a decode worker in another process, by
    # handle (pipeline/engine/kv_store.py). "": nowhere (decode elsewhere recomputes the prompt). A directory
    # on tmpfs (/dev/shm/...) is shared memory between the processes of one host; created with mode 700.
    kv_store_dir: str = ""
    kv_store_mib: int = 2048  # the store's bound: the oldest entries are evicted to stay under it
    kv_store_ttl_s: float = 120.0  # an entry older than this is gone (decode recomputes)
    # local: speculative decoding in the engine's decode steps (docs/engine.md). "ngram": prompt lookup drafts
    # up to num_draft_tokens tokens per sequence and step, verified in the same batched forward (output under
    # greedy is unchanged; it pays when answers copy from the prompt: edits, extraction, code); "off": none
    speculative: Literal["off", "ngram"] = "off"
    num_draft_tokens: int = 4  # 1..16: the most drafts per step (4: made the default after run 1's TEST figures, over run 2's DEV pick of 8; docs/benchmarks.md); adapts between 1 and this
    # local: the precision of the engine's weights. "bfloat16" halves the bytes every step reads (1.2-1.4x the
    # tokens/s on a CPU with AVX-512 BF16, docs/benchmarks.md); greedy answers then differ from float32's
    # wherever two tokens score nearly alike. The KV cache and attention stay float32 on a CPU
    dtype: Literal["float32", "bfloat16"] = "float32"
    # local: an interactive request arriving while a step of batch-lane rows only computes stops it within this
    # share of its layers (1: anywhere, 0.5: in its first half, 0: never). 1 keeps interactive latency lowest
    # beside a backfill; lower values throw less batch work away (docs/backfill.md)
    interrupt_batch_steps: float = 1.0

    @property
    def splits(self) -> bool:
        """Whether the backend has the prefill/decode split (else one generation stage serves its pool)."""
        can = self.kind in ("local", "instant")
        return can if self.split is None else (can and self.split)


@dataclass(frozen=True)
class StateSettings:
    ttl_s: float = 3600.0  # per-request state (stream progress, ownership, cancellations) lives this long
    store: Literal["redis", "memory"] = "redis"  # memory: one process only (tests, a demo without Redis)


DEFAULT_PROFILES = {
    "guarded": ("ingest", "guard", "cache", "route", "prefill", "decode", "postguard", "emit"),
    "bare": ("ingest", "route", "prefill", "decode", "emit"),
}


@dataclass(frozen=True)
class RuntimeSettings:
    torch_threads: int = 2
    model_cache: str = ".cache/models"
    max_in_flight: int = 64  # messages a stage works on at once
    # Tokens a backend yields within this long go as one chunk message (pipeline/stages/coalesce.py); a
    # non-streaming answer waits 200 times as long; 0: a chunk per token
    chunk_window_ms: float = 5.0
    # A stage's output for guard, cache or route running in the same process is handed to it in memory
    # instead of through the broker (pipeline/handling.py); false: every hop crosses the broker
    handover: bool = True
    # Once a process has started (models loaded, stages running), what it loaded is frozen out of the garbage
    # collector's walks (gc.freeze) and its youngest generation is collected after this many net allocations
    # instead of Python's 700 (pipeline/serve.py, settle_gc); 0 keeps Python's defaults
    gc_threshold: int = 10000


@dataclass(frozen=True)
class RunSettings:
    processes: int = 0  # `sluice run`: processes the stages and the bridge are spread over; 0: one per core
    # "every": each of those processes runs a bridge on the one port (SO_REUSEPORT: the kernel spreads the
    # connections) and sends its requests to the partitions its own ingest reads, so a request's answer
    # comes back to its bridge in memory; "first": the first process alone runs the bridge
    bridges: Literal["every", "first"] = "every"


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    limits: LimitSettings = LimitSettings()
    bridge: BridgeSettings = BridgeSettings()
    backends: tuple[BackendSettings, ...] = (BackendSettings(name="local", model="smollm2-135m-instruct", pool="local"),)
    replies: tuple[str, ...] = ("bridge", "sdk")
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    state: StateSettings = field(default_factory=StateSettings)
    run: RunSettings = field(default_factory=RunSettings)
    profile: str = "guarded"  # which row of `profiles` runs
    profiles: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    guard: GuardSettings = field(default_factory=GuardSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)

    @property
    def reply_topics(self) -> frozenset[str]:
        return frozenset(reply_topic(r) for r in self.replies)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.pool for b in self.backends))

    @property
    def unsplit_pools(self) -> frozenset[str]:
        """Pools whose backends cannot split prefill from decode: one generation stage serves each."""
        return frozenset(b.pool for b in self.backends if not b.splits)

    @property
    def stages(self) -> tuple[str, ...]:
        """The stage kinds of the active profile."""
        return self.profiles[self.profile]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.model for b in self.backends))

    @property
    def model_cache(self) -> Path:
        path = Path(self.runtime.model_cache)
        return path if path.is_absolute() else REPO_ROOT / path

    def validate(self) -> Settings:
        if not self.backends:
            raise SettingsError("at least one [[backends]] entry is required")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise SettingsError(f"backend names must be unique: {names}")
        try:
            for b in self.backends:
                routed_topic(b.pool)
            for r in self.replies:
                reply_topic(r)
            reply_topic(self.bridge.reply_name)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.bridge.reply_name not in self.replies:
            raise SettingsError(f"bridge.reply_name {self.bridge.reply_name!r} must be listed in replies")
        for name, value in (("limits.max_tokens_cap", self.limits.max_tokens_cap),
                            ("limits.max_prompt_bytes", self.limits.max_prompt_bytes),
                            ("limits.max_messages", self.limits.max_messages),
                            ("kafka.partitions", self.kafka.partitions),
                            ("runtime.max_in_flight", self.runtime.max_in_flight),
                            ("runtime.torch_threads", self.runtime.torch_threads)):
            if value < 1:
                raise SettingsError(f"{name} must be at least 1, got {value}")
        if self.limits.max_prompt_bytes > MAX_PROMPT_BYTES:
            raise SettingsError(f"limits.max_prompt_bytes may be at most {MAX_PROMPT_BYTES} (a request travels as one "
                                f"Kafka record, 1 MiB at most by default), got {self.limits.max_prompt_bytes}")
        if not self.batch.line_deadline_s <= self.limits.max_deadline_s:  # else ingest refuses every line
            raise SettingsError(f"batch.line_deadline_s ({self.batch.line_deadline_s:g}) may be at most "
                                f"limits.max_deadline_s ({self.limits.max_deadline_s:g})")
        if not (self.state.ttl_s > 0 and self.state.ttl_s >= self.limits.max_deadline_s):  # else a live request's id is reusable
            raise SettingsError(f"state.ttl_s ({self.state.ttl_s:g}) must be positive and at least "
                                f"limits.max_deadline_s ({self.limits.max_deadline_s:g})")
        if not 0 < self.bridge.port < 65536:
            raise SettingsError(f"bridge.port (or SLUICE_BRIDGE_PORT) must be 1 to 65535, got {self.bridge.port}")
        if self.profile not in self.profiles:
            raise SettingsError(f"profile {self.profile!r} is not in [profiles] ({', '.join(self.profiles)})")
        for b in self.backends:
            if b.split and b.kind not in ("local", "instant"):
                raise SettingsError(f"backend {b.name!r}: a {b.kind} backend cannot split prefill from decode (split = true)")
            if not (b.timeout_s > 0 and b.token_delay_ms >= 0 and b.max_batch >= 1):  # NaN fails too
                raise SettingsError(f"backend {b.name!r}: timeout_s must be positive, token_delay_ms 0 or more and max_batch "
                                    f"at least 1, got {b.timeout_s:g}, {b.token_delay_ms:g} and {b.max_batch}")
        if self.kafka.linger_ms < 0 or self.kafka.lingering_ms < 0:
            raise SettingsError(f"kafka.linger_ms and kafka.lingering_ms must not be negative, got {self.kafka.linger_ms} and {self.kafka.lingering_ms}")
        if self.run.processes < 0:
            raise SettingsError(f"run.processes must be 0 (one per core) or more, got {self.run.processes}")
        for b in self.backends:
            if b.kv_store_dir and (b.kind != "local" or b.kv_store_mib < 1 or b.kv_store_ttl_s <= 0):
                raise SettingsError(f"backend {b.name!r}: kv_store_dir needs kind local, kv_store_mib >= 1 and kv_store_ttl_s > 0")
        for b in self.backends:
            if b.speculative != "off" and (b.kind != "local" or not 1 <= b.num_draft_tokens <= 16):
                raise SettingsError(f"backend {b.name!r}: speculative needs kind local and num_draft_tokens 1..16")
            if b.dtype != "float32" and b.kind != "local":
                raise SettingsError(f"backend {b.name!r}: dtype is a local backend's setting")
            if not 0 <= b.interrupt_batch_steps <= 1 or (b.interrupt_batch_steps != 1 and b.kind != "local"):
                raise SettingsError(f"backend {b.name!r}: interrupt_batch_steps is a local backend's setting, 0 to 1")
        for pool in self.pools:  # a pool's generation stages serve one backend: route spreads a model over pools
            if len(serving := [b.name for b in self.backends if b.pool == pool]) > 1:
                raise SettingsError(f"pool {pool!r} has backends {serving}: give each backend its own pool (route "
                                    "spreads a model's requests over its backends by load, each on its pool's topic)")
        for name, kinds in self.profiles.items():
            if problems := check_profile(kinds):
                raise SettingsError(f"profile {name!r}: {'; '.join(problems)}")
        if min(self.bridge.header_timeout_s, self.bridge.body_timeout_s, self.bridge.keep_alive_s) <= 0:
            raise SettingsError("bridge.header_timeout_s, body_timeout_s and keep_alive_s must be positive")
        if self.runtime.gc_threshold < 0:
            raise SettingsError(f"runtime.gc_threshold must be 0 (Python's defaults) or positive, got {self.runtime.gc_threshold}")
        if self.bridge.max_in_flight < 0:
            raise SettingsError(f"bridge.max_in_flight must be 0 (no bound) or positive, got {self.bridge.max_in_flight}")
        if self.bridge.ws_max_requests < 1:
            raise SettingsError(f"bridge.ws_max_requests must be at least 1, got {self.bridge.ws_max_requests}")
        if not (self.bridge.send_timeout_s > 0 and self.bridge.ws_idle_s > 0):  # NaN fails too
            raise SettingsError(f"bridge.send_timeout_s and ws_idle_s must be positive, got {self.bridge.send_timeout_s:g} "
                                f"and {self.bridge.ws_idle_s:g}")
        if not 0 < self.kafka.heartbeat_interval_ms * 3 <= self.kafka.session_timeout_ms:
            raise SettingsError("kafka.heartbeat_interval_ms must be positive and at most a third of session_timeout_ms")
        if problems := self.gateway.problems(self.models, self.replies):
            raise SettingsError("; ".join(problems))
        if problems := self.guard.problems(self.models):
            raise SettingsError("; ".join(problems))
        if problems := self.cache.problems(self.models):
            raise SettingsError("; ".join(problems))
        if problems := self.routing.problems({b.name: b.model for b in self.backends}, frozenset(self.gateway.prices)):
            raise SettingsError("; ".join(problems))
        if problems := self.batch.problems():
            raise SettingsError("; ".join(problems))
        if problems := self.observability.problems(self.bridge.metrics_token):
            raise SettingsError("; ".join(problems))
        return self


def load(path: Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from the TOML file (`path`, else SLUICE_CONFIG, else the repository's sluice.toml) with
    environment overrides. A file named by `path` or SLUICE_CONFIG must exist: defaults in its place would
    quietly drop what it sets (auth_required, say); only the repository's own may be absent."""
    env = os.environ if env is None else env
    named = path is not None or "SLUICE_CONFIG" in env
    path = path or Path(env.get("SLUICE_CONFIG", DEFAULT_CONFIG))
    raw: dict[str, object] = {}
    if named or path.exists():
        try:
            with path.open("rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise SettingsError(f"{path}: cannot read the config file ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    if unknown := unknown_keys(raw, Settings):
        raise SettingsError(f"{path}: " + "; ".join(unknown))
    try:
        settings = msgspec.convert(raw, Settings, strict=True)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"{path}: {_shape_error(str(exc))}") from None
    if "SLUICE_KAFKA_BOOTSTRAP" in env:
        settings = replace(settings, kafka=replace(settings.kafka, bootstrap=env["SLUICE_KAFKA_BOOTSTRAP"]))
    if "SLUICE_REDIS_URL" in env:
        settings = replace(settings, redis=replace(settings.redis, url=env["SLUICE_REDIS_URL"]))
    if "SLUICE_REDIS_USER" in env or "SLUICE_REDIS_PASSWORD" in env:
        settings = replace(settings, redis=replace(settings.redis, username=env.get("SLUICE_REDIS_USER", settings.redis.username),
                                                   password=env.get("SLUICE_REDIS_PASSWORD", settings.redis.password)))
    if "SLUICE_PROFILE" in env:
        settings = replace(settings, profile=env["SLUICE_PROFILE"])
    if "SLUICE_BRIDGE_PORT" in env:
        try:
            port = int(env["SLUICE_BRIDGE_PORT"])
        except ValueError:
            raise SettingsError("SLUICE_BRIDGE_PORT must be an integer") from None
        settings = replace(settings, bridge=replace(settings.bridge, port=port))
    if "SLUICE_METRICS_TOKEN" in env:
        settings = replace(settings, bridge=replace(settings.bridge, metrics_token=env["SLUICE_METRICS_TOKEN"]))
    if "SLUICE_OTLP_ENDPOINT" in env:
        settings = replace(settings, observability=replace(settings.observability, otlp_endpoint=env["SLUICE_OTLP_ENDPOINT"]))
    if "SLUICE_METRICS_PORT" in env:  # one per `sluice worker` process on a host
        try:
            settings = replace(settings, observability=replace(settings.observability, metrics_port=int(env["SLUICE_METRICS_PORT"])))
        except ValueError:
            raise SettingsError("SLUICE_METRICS_PORT must be an integer") from None
    gateway = settings.gateway
    if "SLUICE_KAFKA_USER" in env or "SLUICE_KAFKA_PASSWORD" in env:
        # Credentials in the environment mean the secure profile: SASL, unless the file names SASL_SSL.
        protocol = "SASL_PLAINTEXT" if gateway.kafka.protocol == "PLAINTEXT" else gateway.kafka.protocol
        kafka_security = replace(gateway.kafka, protocol=protocol,
                                 username=env.get("SLUICE_KAFKA_USER", gateway.kafka.username),
                                 password=env.get("SLUICE_KAFKA_PASSWORD", gateway.kafka.password))
        gateway = replace(gateway, kafka=kafka_security)
    if "SLUICE_GATEWAY_SECRET" in env:
        gateway = replace(gateway, client_info_secret=env["SLUICE_GATEWAY_SECRET"])
    settings = replace(settings, gateway=gateway)
    return settings.validate()


def _shape_error(message: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.kafka.partitions`" as "`kafka.partitions`: expected ..."."""
    problem, sep, where = message.rpartition(" - at `")
    if not sep:
        return message
    where = where.rstrip("`")
    allowed = describe(Settings, where)
    return f"`{where.removeprefix('$.')}`: {problem[:1].lower()}{problem[1:]}" + (f" (allowed: {allowed})" if allowed else "")

"""The time the gateway adds to ingest: API-key authentication, model and network checks, and rate
limits on four scopes (key, tenant, client address, global; requests and tokens per minute) in one
pipelined round trip to real Redis, against the foundation's ingest (validation only), same run.

Each sample is one `IngestStage.handle` call, timed with perf_counter; the two variants alternate so
drift on the shared machine hits both alike. Starts its own Redis (infra/redis/start.sh, port 16479)
unless --redis-url is given.

    .venv/bin/python -m bench.ingest_auth [--n 5000] [--redis-url redis://127.0.0.1:16379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
import uuid
from dataclasses import replace
from pathlib import Path

from bench.stats import row
from pipeline.assemble import nodes_of
from pipeline.gateway.build import redis_client, redis_gateway
from pipeline.gateway.config import GatewaySettings, TenantPolicy
from pipeline.gateway.keys import KeyManager
from pipeline.gateway.network import attest
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.settings import RedisSettings, Settings
from pipeline.stage import Out, Stopwatch
from pipeline.stages.ingest import IngestStage
from topics.hops import Admitted, request_key
from topics.requests import ChatMessage, Request, Sampling

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret"


def request(settings: Settings, key: str | None) -> Request:
    rid = uuid.uuid4().hex
    ip, agent = "10.1.2.3", "bench/1.0"
    return Request(
        id=rid, reply_to="llm.responses.sdk", model=settings.models[0], created_at=time.time(),
        messages=(ChatMessage(role="user", content="Summarise the plot of Hamlet in three sentences. " * 4),),
        sampling=Sampling(max_tokens=64), api_key=key, client_ip=ip, user_agent=agent,
        client_attestation=attest(SECRET, rid, ip, agent),
    )


async def time_one(stage: IngestStage, message: Request) -> float:
    started = time.perf_counter()
    async for _ in stage.handle(message):
        pass
    return (time.perf_counter() - started) * 1000.0


async def measure(url: str, n: int) -> None:
    limits = dict(global_rpm=10**9, global_tpm=10**12, ip_rpm=10**9, ip_tpm=10**12)
    gateway = GatewaySettings(auth_required=True, client_info_secret=SECRET,
                              tenants={"bench": TenantPolicy(rpm=10**9, tpm=10**12, budget=10**9)}, **limits)
    settings = replace(Settings(), redis=RedisSettings(url=url), gateway=gateway)
    admin = redis_client(settings)
    key, _ = await KeyManager(RedisKeyStore(admin), rotate_overlap_s=60).create("bench", rpm=10**9, tpm=10**12, budget=10**9)
    await admin.aclose()
    # The id's claim stays in the in-memory state store in both gateway variants: the figure is the gateway's.
    topics = nodes_of(settings, ["ingest"])[0].topics
    plain = IngestStage(replace(settings, gateway=GatewaySettings()), topics)  # no credentials, memory limiter
    plain_foundation = _FoundationIngest(settings, topics)
    gated = IngestStage(settings, topics, redis_gateway(settings))
    for _ in range(200):  # warm-up: connections, script cache, key cache
        await time_one(gated, request(settings, key))
        await time_one(plain_foundation, request(settings, None))
    base, auth, anon = [], [], []
    for _ in range(n):
        base.append(await time_one(plain_foundation, request(settings, None)))
        auth.append(await time_one(gated, request(settings, key)))
        anon.append(await time_one(plain, request(settings, None)))
    await gated.aclose()
    added = sorted(a - b for a, b in zip(auth, base, strict=True))
    print(f"n={n} per variant, Redis at {url}\n")
    print("| measured | p50 ms | p99 ms | mean ms | n |\n| --- | --- | --- | --- | --- |")
    print(row("foundation ingest (validation only)", base))
    print(row("ingest + gateway, no credentials (auth off, in-memory limiter)", anon))
    print(row("ingest + gateway: key auth + 4-scope limits in Redis", auth))
    print(row("**added by the gateway** (paired difference)", added))


class _FoundationIngest(IngestStage):
    """The foundation's ingest: validation and the admitted message, no gateway call and no id claim."""

    async def handle(self, message: Request):  # type: ignore[no-untyped-def,override]
        clock = Stopwatch()
        now = time.time()
        self.check(message)
        rid = request_key(message.tenant, message.id)
        yield Out(self.topics.forward or "", rid, Admitted(id=rid, request=message, tenant=message.tenant,
                                                           principal=message.tenant, admitted_at=now,
                                                           timings={self.name: clock.ms()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    state = ROOT / ".state" / "bench-ingest-auth"
    url = args.redis_url
    if url is None:
        state.mkdir(parents=True, exist_ok=True)
        subprocess.run([ROOT / "infra" / "redis" / "start.sh", state, "16479"], check=True)
        url = "redis://127.0.0.1:16479/0"
    try:
        asyncio.run(measure(url, args.n))
    finally:
        if args.redis_url is None:
            subprocess.run(["redis-cli", "-p", "16479", "shutdown", "nosave"], check=False, capture_output=True)


if __name__ == "__main__":
    main()

"""`sluice cache purge --tenant T [--model M]`: forget a tenant's cached answers (of one model, or all).

The exact tier's keys are deleted from Redis (found by their prefix, `keys.scope`); a `Purge` record on
`llm.cache.entries` makes every cache worker drop the semantic entries stored before it, now and when
it rebuilds its index from the topic later.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time

import msgspec

from pipeline.cache import keys
from pipeline.cache.exact import RedisExactTier
from pipeline.gateway.build import redis_client
from pipeline.producing import Producer
from pipeline.settings import Settings
from topics import codec, registry
from topics.cache import Purge


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cache = sub.add_parser("cache", help="manage the answer cache")
    actions = cache.add_subparsers(dest="action", required=True)
    purge = actions.add_parser("purge", help="forget a tenant's cached answers")
    purge.add_argument("--tenant", required=True)
    purge.add_argument("--model", default=None, help="only this model's answers")


def purge_key(tenant: str, model: str | None) -> bytes:
    """The purge's record key on the compacted topic: one per (tenant, model), unambiguous. It was
    `purge/<tenant>/<model>`, which tenant `a/b` with model `c` and tenant `a` with model `b/c` (model
    names like `org/name` are common) shared: compaction kept the later purge and lost the other, whose
    purged answers came back at the next rebuild."""
    return b"purge/" + hashlib.sha256(msgspec.json.encode([tenant, model])).hexdigest().encode()


async def run(settings: Settings, args: argparse.Namespace) -> int:
    record = Purge(tenant=args.tenant, model=args.model, at=time.time())
    producer = Producer(settings, "sluice-cache-purge")
    await producer.start(asyncio.Event())
    try:
        await producer.send_and_wait(registry.CACHE_ENTRIES, codec.encode(record), key=purge_key(args.tenant, args.model))
    finally:
        await producer.stop()
    exact = RedisExactTier(redis_client(settings))
    try:
        removed = await exact.purge(keys.scope(args.tenant, args.model))
    finally:
        await exact.aclose()
    scope = f"tenant {args.tenant!r}" + (f", model {args.model!r}" if args.model else "")
    print(f"purged {scope}: {removed} exact entries deleted; semantic entries dropped by every cache worker")
    return 0

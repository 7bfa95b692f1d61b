"""`sluice keys create|revoke|rotate|list`: API keys in the configured Redis. A new key is printed once."""

from __future__ import annotations

import argparse

from pipeline.gateway.build import redis_client
from pipeline.gateway.errors import KeyChanged
from pipeline.gateway.keys import KeyManager, KeyNotFound, KeyRecord
from pipeline.gateway.limits import Scope
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.gateway.redis_limits import RedisLimiter
from pipeline.settings import Settings


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keys = sub.add_parser("keys", help="manage API keys (stored as SHA-256 hashes in Redis)")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--models", default="", help="comma-separated; empty: every model")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    create.add_argument("--budget", type=float, default=0.0, help="spend limit (0: none)")
    rotate = actions.add_parser("rotate", help="a new key for KEY_ID; the old one works for the overlap")
    rotate.add_argument("key_id")
    rotate.add_argument("--overlap-s", type=float, default=None, help="default: gateway.rotate_overlap_s")
    revoke = actions.add_parser("revoke", help="revoke KEY_ID at once (ingest caches lookups for key_cache_s)")
    revoke.add_argument("key_id")
    actions.add_parser("list", help="every key, without secrets")


async def run(settings: Settings, args: argparse.Namespace) -> int:
    redis = redis_client(settings)
    try:
        manager = KeyManager(RedisKeyStore(redis), rotate_overlap_s=settings.gateway.rotate_overlap_s)
        try:
            if args.action == "create":
                models = tuple(m for m in args.models.split(",") if m)
                unknown = sorted(set(models) - set(settings.models))
                if unknown:
                    print(f"unknown models: {', '.join(unknown)}; configured: {', '.join(settings.models)}")
                    return 2
                raw, record = await manager.create(args.tenant, models=models, rpm=args.rpm, tpm=args.tpm, budget=args.budget)
                _print_new(raw, record)
            elif args.action == "rotate":
                raw, record = await manager.rotate(args.key_id, overlap_s=args.overlap_s)
                _print_new(raw, record)
            elif args.action == "revoke":
                record = await manager.revoke(args.key_id)
                print(f"revoked {record.key_id}")
            else:
                limiter = RedisLimiter(redis, settings.gateway.window_s)
                print("key_id\ttenant\tmodels\trpm\ttpm\tbudget\tspent\tstatus\tkey ends")
                for r in await manager.list():
                    # Spend is kept only against a budget (`sluice usage` sums every charge from llm.usage).
                    spent = f"{await limiter.spent(Scope('key', r.key_id)):.4f}" if r.budget else "-"
                    status = "revoked" if r.revoked else f"active ({len(r.hashes)} keys)"
                    print(f"{r.key_id}\t{r.tenant}\t{','.join(r.models) or '*'}\t{r.rpm}\t{r.tpm}\t{r.budget}\t{spent}\t{status}\t...{r.hint}")
        except (KeyNotFound, KeyChanged) as exc:  # changed: another rotate or revoke ran at the same time
            print(exc)
            return 1
        except ValueError as exc:
            print(f"refused: {exc}")
            return 2
        return 0
    finally:
        await redis.aclose()


def _print_new(raw: str, record: KeyRecord) -> None:
    print(f"key_id: {record.key_id}\ntenant: {record.tenant}")
    print(f"api key (shown once, store it now): {raw}")

"""Per-request state shared by the workers of a stage: a small hash of byte fields per key (a request
id), each key with a TTL, with an owner field that fences a worker that lost the request to another.
It replaces the bounded dicts that stages kept in process memory, which a rebalance or a restart lost.

    store           the StateStore protocol (read, write fenced by owner, claim once, take over, forget)
                    and MemoryStateStore: bounded, expiring, for one process (unit tests, the embedded demo)
    redis_store     RedisStateStore: one hash per key under its own hash tag, one round trip per call,
                    a TTL on every key; the atomic calls are Lua scripts in `lua/*.lua`
    metered         MeteredStore: any store, counting a stage's takeovers and fenced writes (Prometheus);
                    `pipeline.assemble` wraps every stage's store in one

Errors: the Redis store raises `pipeline.errors.InfraUnavailable` when Redis is away (the runner retries
the message until its deadline); the message names the error's class, never the URL.
"""

from pipeline.state.redis_store import RedisStateStore
from pipeline.state.store import MemoryStateStore, StateStore

__all__ = ["MemoryStateStore", "RedisStateStore", "StateStore"]

"""The Gateway a stage uses, built from settings: Redis stores, or memory stores for tests and tools."""

from __future__ import annotations

import functools
from importlib import metadata

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from pipeline.gateway.gateway import Gateway
from pipeline.gateway.jwt_auth import JwtVerifier
from pipeline.gateway.keys import MemoryKeyStore
from pipeline.gateway.limits import MemoryLimiter
from pipeline.gateway.redis_keys import RedisKeyStore
from pipeline.gateway.redis_limits import RedisLimiter
from pipeline.redis_lean import LeanRedis
from pipeline.settings import REPO_ROOT, Settings


def redis_client(settings: Settings) -> Redis:
    """A client that fails fast (short timeouts, one immediate retry): the gateway decides what Redis being
    away means. The retry is for a pooled connection that died with a Redis restart: it reconnects at
    once. Every script is idempotent per request id, so a retried command never counts twice. In the
    secure profile it authenticates as an ACL user (settings.redis: username, password)."""
    timeout = settings.gateway.redis_timeout_s
    credentials = {"username": settings.redis.username or None, "password": settings.redis.password or None}
    return Redis.from_url(
        settings.redis.url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1),
        health_check_interval=0, driver_info=_driver_info(),
        **{k: v for k, v in credentials.items() if v},  # a user or password in the URL wins
    )


def stage_redis(settings: Settings) -> Redis | LeanRedis:
    """The client of the stages' stores, on a request's path: `LeanRedis` (one pipelined connection, about
    half of redis-py's CPU per call; bench/redis_client.py), with the same timeout, the same single retry
    and the same credentials as `redis_client`. A TLS URL (`rediss://`) gets redis-py's, which speaks TLS."""
    if settings.redis.url.startswith("rediss://"):
        return redis_client(settings)
    return LeanRedis.from_url(settings.redis.url, timeout_s=settings.gateway.redis_timeout_s,
                              username=settings.redis.username or None, password=settings.redis.password or None)


@functools.cache
def _driver_info() -> DriverInfo:
    """What each connection tells Redis it is (CLIENT SETINFO: `redis-py(sluice_v0.1.0)` in CLIENT LIST), made
    once: left to redis-py, every new connection reads the package's metadata from disk again (about 0.3
    ms; a pool grows under load, and reconnects after a timeout or a Redis restart)."""
    try:
        version = metadata.version("sluice")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        version = "0"
    return DriverInfo().add_upstream_driver("sluice", version)


def _jwt(settings: Settings) -> JwtVerifier | None:
    return JwtVerifier(settings.gateway.jwt, REPO_ROOT) if settings.gateway.jwt.enabled else None


def redis_gateway(settings: Settings, redis: Redis | LeanRedis | None = None) -> Gateway:
    redis = redis or stage_redis(settings)
    return Gateway(settings.gateway, RedisKeyStore(redis), RedisLimiter(redis, settings.gateway.window_s), _jwt(settings))


def memory_gateway(settings: Settings) -> Gateway:
    return Gateway(settings.gateway, MemoryKeyStore(), MemoryLimiter(settings.gateway.window_s), _jwt(settings))

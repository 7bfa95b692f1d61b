"""LeanRedis without a server: how it writes commands and reads its URL (tests/integration/test_redis_lean.py
runs it against redis-server)."""

from __future__ import annotations

import pytest

from pipeline.redis_lean import LeanRedis, pack


def test_commands_are_written_as_resp_bulk_strings() -> None:
    assert pack(["SET", "k", b"\x00\r\n", 12, 0.5]) == b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n\x00\r\n\r\n$2\r\n12\r\n$3\r\n0.5\r\n"
    with pytest.raises(TypeError):
        pack(["SET", "k", True])  # redis-py refuses a bool too; it would be ambiguous
    with pytest.raises(TypeError):
        pack(["SET", "k", None])  # type: ignore[list-item]


def test_urls_give_address_database_and_credentials() -> None:
    client = LeanRedis.from_url("redis://us%40er:p%3Ass@10.0.0.7:6380/3", timeout_s=0.5)
    assert (client._address, client._db, client._auth) == (("10.0.0.7", 6380), 3, ["us@er", "p:ss"])
    from_settings = LeanRedis.from_url("redis://127.0.0.1:6379/0", username="sluice", password="pw")
    assert from_settings._auth == ["sluice", "pw"]
    assert LeanRedis.from_url("redis://:only@h/0")._auth == ["only"]
    assert LeanRedis.from_url("unix:///run/redis.sock?db=2")._unix_path == "/run/redis.sock"
    with pytest.raises(ValueError):
        LeanRedis.from_url("rediss://h:6379/0")


def test_calls_past_their_deadline_behind_a_busy_loop_are_graced_together_then_fail_together() -> None:
    """A late timer (the loop held past every deadline) gives each call already due one more timeout; Redis
    still silent after it, they all fail at once. Graced one by one, each found the next late in turn: 20
    calls at 0.25 s failed one per timeout, over 3.75 s, on a stalled Redis."""
    import asyncio
    import time

    from redis.exceptions import TimeoutError as RedisTimeoutError

    from pipeline.redis_lean import _Connection

    class Silent(asyncio.Transport):  # a Redis that has stalled: takes every write, answers nothing
        def write(self, data: object) -> None:
            pass

        def abort(self) -> None:
            pass

    async def run() -> list[float]:
        connection = _Connection(0.25)
        connection.connection_made(Silent())
        loop = asyncio.get_running_loop()
        started = loop.time()
        calls = [connection.send(b"PING\r\n", 1) for _ in range(20)]
        await asyncio.sleep(0)
        time.sleep(0.5)  # the loop is busy past every deadline by more than half a timeout
        failed_at: list[float] = []
        for call in calls:
            try:
                await call
            except RedisTimeoutError:
                failed_at.append(loop.time() - started)
        return failed_at

    failed_at = asyncio.run(run())
    assert len(failed_at) == 20
    assert max(failed_at) - min(failed_at) < 0.1, failed_at  # together, not one timeout apart
    assert max(failed_at) < 1.5  # 0.5 s held, then one timeout of grace (0.25 s), with room for a slow host

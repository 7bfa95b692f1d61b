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

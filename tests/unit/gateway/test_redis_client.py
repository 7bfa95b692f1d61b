"""The gateway's Redis client: every connection of its pool shares one DriverInfo, so opening one does
not read redis-py's package metadata from disk again (about 0.3 ms a connection, paid on every reconnect)."""

from __future__ import annotations

import pytest
import redis.utils

from pipeline import settings as settings_module
from pipeline.gateway.build import redis_client


def test_new_connections_do_not_look_up_the_library_version(monkeypatch: pytest.MonkeyPatch) -> None:
    client = redis_client(settings_module.load(env={}))
    looked_up: list[int] = []
    monkeypatch.setattr(redis.utils, "get_lib_version", lambda: looked_up.append(1) or "0")
    connections = [client.connection_pool.make_connection() for _ in range(3)]
    assert looked_up == []
    assert {id(c.driver_info) for c in connections} == {id(client.connection_pool.connection_kwargs["driver_info"])}
    assert connections[0].driver_info.formatted_name.startswith("redis-py(sluice_v")  # what CLIENT LIST shows

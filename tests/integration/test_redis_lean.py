"""LeanRedis against a real redis-server: the same replies and exceptions as redis-py for every command the
stores call, replies matched to their callers under concurrency and cancellation, and what happens when
Redis restarts, stalls, refuses a password or is not there."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline import redis_lean
from pipeline.redis_lean import LeanRedis, pack
from pipeline.settings import Settings
from tests.ports import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")


def own_redis(port: int, state: Path, *extra: str) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(state), *extra], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while subprocess.run(["redis-cli", "-p", str(port), *(["-a", extra[-1]] if extra else []), "ping"],
                         capture_output=True, text=True).stdout.strip() not in ("PONG", "NOAUTH Authentication required."):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    return process


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    process = own_redis(port, tmp_path)
    yield port, process
    process.kill()
    process.wait()


@pytest_asyncio.fixture(loop_scope="session")
async def both(settings: Settings) -> AsyncIterator[tuple[LeanRedis, Redis]]:
    lean = LeanRedis.from_url(settings.redis.url, timeout_s=2.0)
    py = Redis.from_url(settings.redis.url, socket_timeout=2)
    yield lean, py
    await lean.aclose()
    await py.aclose()


def name() -> str:
    return "sluice:test-lean:{" + uuid.uuid4().hex + "}"


async def test_every_command_answers_as_redis_py_does(both: tuple[LeanRedis, Redis]) -> None:
    lean, py = both
    h, s, t, members = name(), name(), name(), name()
    async with lean.pipeline(transaction=True) as pipe:
        assert await pipe.hset(h, items=["a", b"1", "b", bytes(range(256))]).pexpire(h, 60_000).execute() == [2, True]
    assert await lean.hgetall(h) == await py.hgetall(h) == {b"a": b"1", b"b": bytes(range(256))}
    assert await lean.hgetall(name()) == await py.hgetall(name()) == {}
    assert await lean.set(s, b"v", px=60_000) is True
    assert await lean.get(s) == await py.get(s) == b"v"
    assert 0 < await py.pttl(s) <= 60_000
    assert await lean.set(t, "w", pxat=int(time.time() * 1000) + 60_000) is True
    assert 0 < await py.pttl(t) <= 60_000
    assert await lean.getdel(s) == b"v" and await lean.get(s) is None and await lean.getdel(s) is None
    async with lean.pipeline(transaction=False) as pipe:
        assert await pipe.sadd(members, "x", "y").sadd(members, "x").set(s, 7).delete(name()).execute() == [2, 0, True, 0]
    assert await lean.smembers(members) == await py.smembers(members) == {b"x", b"y"}
    assert await lean.delete(h, t, members, name()) == 3
    async with lean.pipeline(transaction=False) as pipe:
        assert await pipe.execute() == []  # nothing queued: no round trip, as redis-py
    sha = await lean.script_load("return {KEYS[1], ARGV[1], 7}")
    assert sha == await py.script_load("return {KEYS[1], ARGV[1], 7}")
    assert await lean.evalsha(sha, 1, "k", 3.5) == await py.evalsha(sha, 1, "k", 3.5) == [b"k", b"3.5", 7]


async def test_scan_iter_visits_every_matching_key(both: tuple[LeanRedis, Redis]) -> None:
    lean, py = both
    prefix = "sluice:test-lean-scan:" + uuid.uuid4().hex + ":"
    async with lean.pipeline(transaction=False) as pipe:
        for i in range(1_200):
            pipe.set(f"{prefix}{i}", i, px=60_000)
        await pipe.execute()
    found = [key async for key in lean.scan_iter(match=prefix + "*", count=100)]
    assert sorted(found) == sorted(f"{prefix}{i}".encode() for i in range(1_200))
    assert await lean.delete(*found) == 1_200


async def test_errors_are_redis_pys_exceptions(both: tuple[LeanRedis, Redis]) -> None:
    lean, _ = both
    with pytest.raises(NoScriptError):
        await lean.evalsha("0" * 40, 0)
    s = name()
    await lean.set(s, b"v", px=60_000)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await lean.hgetall(s)
    ok = name()
    with pytest.raises(ResponseError, match="WRONGTYPE"):  # a pipeline raises its first error, after running all
        async with lean.pipeline(transaction=False) as pipe:
            await pipe.set(ok, b"1", px=60_000).sadd(s, "m").execute()
    assert await lean.get(ok) == b"1"
    with pytest.raises(ResponseError):  # a transaction that Redis refused while queueing runs nothing
        async with lean.pipeline(transaction=True) as pipe:
            await pipe.set(name(), b"1").evalsha("not-a-sha", -1).execute()
    assert await lean.get(s) == b"v"  # the connection is still in step after every error


async def test_concurrent_and_cancelled_callers_each_get_their_own_reply(both: tuple[LeanRedis, Redis]) -> None:
    lean, _ = both
    replies = await asyncio.gather(*(lean.execute("ECHO", str(i)) for i in range(2_000)))
    assert replies == [str(i).encode() for i in range(2_000)]
    slow = asyncio.ensure_future(lean.execute("BLPOP", name(), "0.2"))  # holds the connection 0.2 s
    after = [asyncio.ensure_future(lean.execute("ECHO", f"after-{i}")) for i in range(3)]
    await asyncio.sleep(0.05)
    slow.cancel()  # its reply still comes, first, and must go to nobody
    assert await asyncio.gather(*after) == [b"after-0", b"after-1", b"after-2"]
    assert await lean.execute("ECHO", "later") == b"later"


async def test_calls_made_in_one_turn_go_out_in_one_write_and_share_one_timer(both: tuple[LeanRedis, Redis]) -> None:
    lean, _ = both
    await lean.execute("PING")
    connection = lean._connection
    assert connection is not None and connection._transport is not None
    transport = connection._transport
    writes: list[bytes] = []
    write = transport.write
    transport.write = lambda data: (writes.append(data), write(data))[1]  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    timers = 0
    call_at = loop.call_at

    def counting_call_at(when: float, callback: Any, *args: object, **kwargs: Any) -> asyncio.TimerHandle:
        # The loop is the session's: other tests' Kafka clients set timers meanwhile (with `context=`).
        # Only the client's own watch timers are counted, and every call goes through unchanged.
        nonlocal timers
        timers += getattr(callback, "__self__", None) is connection
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        replies = await asyncio.gather(*(lean.execute("ECHO", str(i)) for i in range(16)))
        alone = await lean.execute("ECHO", "alone")
    finally:
        del loop.call_at  # the class's method again
        transport.write = write  # type: ignore[method-assign]
    assert replies == [str(i).encode() for i in range(16)] and alone == b"alone"
    assert len(writes) == 2  # the 16, then the lone call
    assert writes[0] == b"".join(pack(["ECHO", str(i)]) for i in range(16))
    assert timers <= 2  # at most one set at the first call and none for the others (one more if it fired)


async def test_a_restarted_redis_is_reconnected_to_by_the_next_call(private_redis: tuple[int, subprocess.Popen[bytes]],
                                                                    tmp_path: Path) -> None:
    port, process = private_redis
    lean = LeanRedis(port=port, timeout_s=1.0)
    await lean.set("k", b"1")
    process.kill()
    process.wait()
    await asyncio.sleep(0.1)  # the connection is closed under the client
    with pytest.raises(RedisConnectionError):
        await lean.get("k")
    restarted = own_redis(port, tmp_path)
    try:
        assert await lean.get("k") is None  # a new connection, to a Redis that restarted empty
        await lean.set("k", b"2")
        assert await lean.get("k") == b"2"
    finally:
        await lean.aclose()
        restarted.kill()
        restarted.wait()


async def test_a_stalled_redis_times_out_and_the_client_recovers(private_redis: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, process = private_redis
    lean = LeanRedis(port=port, timeout_s=0.3)
    await lean.set("k", b"1")
    os.kill(process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(lean.get("k") for _ in range(5)), return_exceptions=True)
        waited = time.monotonic() - started
        assert all(isinstance(r, RedisTimeoutError) for r in results), results
        assert waited < 0.8  # one timeout of 0.3 s: no second try, on the same connection or another
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert await lean.get("k") == b"1"
    await lean.aclose()


async def test_a_stalled_redis_keeps_the_connection_and_its_late_replies_go_to_no_one(
    private_redis: tuple[int, subprocess.Popen[bytes]],
) -> None:
    """A timed-out call is abandoned, not its connection: a hung Redis (SIGSTOP) is not sent a new
    connection per timeout (the chaos suite's 20 s hang filled Redis's 511 pending connections, and the
    ones past that waited 1-3 s for the kernel's retransmissions once it resumed), and when it answers,
    the replies of the abandoned calls are dropped in order, never handed to the calls after them."""
    port, process = private_redis
    lean = LeanRedis(port=port, timeout_s=0.3)
    await lean.set("old", b"abandoned")
    await lean.set("new", b"answered")
    connection = lean._connection
    os.kill(process.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            with pytest.raises(RedisTimeoutError):
                await lean.get("old")
        assert lean._connection is connection and connection is not None and connection.open
    finally:
        os.kill(process.pid, signal.SIGCONT)
    started = time.monotonic()
    assert await lean.get("new") == b"answered"  # behind the three abandoned replies, on the same socket
    assert time.monotonic() - started < 0.3 and lean._connection is connection
    await lean.aclose()


async def test_a_connection_silent_past_the_dead_check_is_dropped_and_new_calls_still_time_out(
    private_redis: tuple[int, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, process = private_redis
    monkeypatch.setattr(redis_lean, "DEAD_AFTER_S", 0.6)
    lean = LeanRedis(port=port, timeout_s=0.2)
    await lean.set("k", b"1")
    connection = lean._connection
    assert connection is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RedisTimeoutError):
            await lean.get("k")  # abandoned: the timer now waits for the dead check
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await lean.get("k")  # its own 0.2 s, not the dead check's
        assert time.monotonic() - started < 0.45
        await asyncio.sleep(0.7)
        assert not connection.open  # no reply for 0.6 s past the first call's deadline
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert await lean.get("k") == b"1"  # on a fresh connection
    assert lean._connection is not connection
    await lean.aclose()


async def test_passwords_are_sent_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    port = free_port()
    process = own_redis(port, tmp_path, "--requirepass", "s3cret")
    try:
        good = LeanRedis.from_url(f"redis://:s3cret@127.0.0.1:{port}/1", timeout_s=1.0)
        await good.set("k", b"db1")
        assert await good.get("k") == b"db1"
        other_db = LeanRedis(port=port, password="s3cret", timeout_s=1.0)
        assert await other_db.get("k") is None  # SELECT 1 was sent for the first
        bad = LeanRedis(port=port, password="wrong", timeout_s=1.0)
        with pytest.raises(AuthenticationError) as refused:
            await bad.get("k")
        assert "wrong" not in str(refused.value)
        for client in (good, other_db, bad):
            await client.aclose()
    finally:
        process.kill()
        process.wait()


async def test_nothing_listening_fails_fast_without_naming_the_secret() -> None:
    lean = LeanRedis.from_url("redis://:hunter2@127.0.0.1:1/0", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RedisConnectionError) as caught:
        await lean.get("k")
    assert time.monotonic() - started < 2.5
    assert "hunter2" not in str(caught.value)


async def test_a_busy_event_loop_is_not_taken_for_a_stalled_redis(settings: Settings) -> None:
    """On uvloop (what sluice runs) a callback that holds the loop past a call's deadline delays the call
    too: a small write is queued and goes out only after the callback (uvloop's check phase), and the
    timers run before the reply can be read. The late timer must give the call a whole timeout of loop
    time, not take the busy loop for a stalled Redis. Redis takes 20 ms to answer here, so a grace of
    1 ms (the code before, flaky in CI when Redis was slow) fails every time."""
    import uvloop

    async def busy() -> None:
        lean = LeanRedis.from_url(settings.redis.url, timeout_s=0.2)
        key = name()
        await lean.set(key, b"1", px=60_000)
        connection = lean._connection
        assert connection is not None
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        sent: list[asyncio.Future[list[object]]] = []

        def stall() -> None:  # another socket's input, handled slowly
            ours.recv(1)
            loop.remove_reader(ours)
            # WAIT for a replica this Redis does not have: it answers 0 after 20 ms, then the GET (a script
            # looping on TIME never ends on Redis 7.2+, whose time stands still inside a script)
            sent.append(connection.send(pack(["WAIT", "1", "20"]) + pack(["GET", key]), 2))
            connection._flush()  # queued by uvloop: written once this callback returns
            time.sleep(0.5)  # the call's deadline (0.2 s) passes while the loop is held

        loop.add_reader(ours, stall)
        theirs.send(b"x")
        while not sent:
            await asyncio.sleep(0.01)
        assert await sent[0] == [0, b"1"]
        assert lean._connection is connection and connection.open
        await lean.aclose()
        ours.close()
        theirs.close()

    checked: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def busy_then_report() -> None:
        try:
            await busy()
        except BaseException as exc:
            checked.set_exception(exc)
            raise
        checked.set_result(None)

    # A daemon thread, not asyncio.to_thread: once (session 42) uvloop's loop.close() never returned after
    # the checks had passed (waiting in epoll_pwait), and CI hung on the pool's thread; the checks are
    # what this test is about, and a daemon thread cannot hold the process at its exit.
    threading.Thread(target=uvloop.run, args=(busy_then_report(),), daemon=True).start()
    await asyncio.wait_for(asyncio.wrap_future(checked), 30.0)

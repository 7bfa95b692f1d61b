"""The Redis client of the stages' stores: one pipelined connection per client, commands written as RESP
by hand, replies parsed by hiredis. redis-py (with hiredis) costs 85-135 µs of CPU per round trip here,
most of it its connection pool, locks and stream reader, and a request makes about 14; this one costs
about half of that one call at a time and a quarter with many calls in flight, because every caller
shares one socket and Redis answers in order (bench/redis_client.py).

It speaks the part of `redis.asyncio.Redis` that the state store, the limiter, the key store and the exact
cache call, with the same replies and the same exceptions (`redis.exceptions`, mapped by redis-py's own
table), so a store runs on either client. Like `pipeline.gateway.build.redis_client` it fails fast: each
call waits `timeout_s` at most (once more from a late timer, when the event loop was busy), and is sent once more on a fresh connection when the connection broke
(every script is idempotent per request id, so a retry never counts twice). A call that timed out is
abandoned, not its connection: replies come in order, so its reply, if it comes, is read and dropped, and
the calls after it keep their places. Only when an abandoned call has had no reply for `DEAD_AFTER_S`
is the connection taken for dead and dropped (the next call connects afresh). Dropping the connection at
every timeout, as this client did first, opened a connection per timed-out call: a Redis hung for 20 s
(SIGSTOP, the chaos suite) had 510 of its 511 pending connections queued when it resumed, and streams
came back in clusters 1 and 2 s late, most likely the kernel's retransmissions of the handshakes it
dropped past the queue.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | bytes | int | float
_RETRIED = RedisConnectionError  # BusyLoadingError (LOADING) is a ConnectionError too
DEAD_AFTER_S = 3.0  # an abandoned call without a reply this long: the connection is dropped


def pack(args: Sequence[Arg]) -> bytes:
    """One command as a RESP array of bulk strings; a float as `repr`, as redis-py writes it. hiredis's
    encoder (C; under half the CPU of a loop in Python) writes the same bytes and refuses the same
    types, bool among them."""
    try:
        return hiredis.pack_command(args if isinstance(args, tuple) else tuple(args))
    except TypeError:
        bad = next((a for a in args if isinstance(a, bool) or not isinstance(a, str | bytes | int | float)), None)
        raise TypeError(f"a Redis argument must be str, bytes, int or float, not {type(bad).__name__}") from None


def _raise_errors(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, hiredis.ReplyError):
            raise BaseParser.parse_error(str(reply))


@dataclass(slots=True)
class _Waiting:
    future: asyncio.Future[list[Any]]
    expected: int
    deadline: float
    replies: list[Any] = field(default_factory=list)
    graced: bool = False


class _Connection(asyncio.Protocol):
    """One socket; replies come back in the order the commands went out, so the oldest waiting call
    owns the next reply. Two things are done once for many calls rather than once per call:

    - Commands sent in one turn of the event loop go out in one write (`_flush`, scheduled by the
      first of them), so Redis reads them in one read and answers them in one write: fewer system
      calls on both sides when several requests are in flight, the same latency for a lone call (the
      write waits only for the callbacks already due).
    - One timer watches the oldest waiting call. Deadlines are the send time plus the same timeout,
      so the oldest call's is the earliest; the timer is set again, for the next oldest, only when it
      fires. A timer per call cost a timer handle and its cancellation per round trip. (While only
      abandoned calls wait, it is set for the dead check, and the next call sets it earlier.)
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader()
        self._waiting: deque[_Waiting] = deque()
        self._transport: asyncio.Transport | None = None
        self._unsent: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._abandoned = 0  # the oldest waiting calls, timed out: their replies are read and dropped
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("Connection closed by server."))

    def data_received(self, data: bytes) -> None:
        try:
            self._reader.feed(data)
            while (reply := self._reader.gets()) is not False:
                waiting = self._waiting[0]
                waiting.replies.append(reply)
                if len(waiting.replies) == waiting.expected:
                    self._waiting.popleft()
                    self._abandoned = max(0, self._abandoned - 1)
                    if not waiting.future.done():  # its caller may have been cancelled
                        waiting.future.set_result(waiting.replies)
        except (hiredis.ProtocolError, IndexError):  # garbage, or a reply nobody asked for
            self.fail(RedisConnectionError("Protocol error, the connection was dropped."))

    def send(self, data: bytes, expected: int) -> asyncio.Future[list[Any]]:
        """Queues `data` (which must make Redis answer `expected` replies) for this turn's write; the
        future gets the replies."""
        if not self.open or self._transport is None:
            raise RedisConnectionError("Connection closed.")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop.create_future(), expected, loop.time() + self._timeout_s)
        self._waiting.append(waiting)
        if not self._unsent:
            loop.call_soon(self._flush)
        self._unsent.append(data)
        if self._timer is None or self._timer.when() > waiting.deadline:  # none, or only the dead check's
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(waiting.deadline, self._expire)
        return waiting.future

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        if self.open and self._transport is not None and unsent:
            self._transport.write(b"".join(unsent))

    def _expire(self) -> None:
        """The watch timer: abandons the oldest calls still waiting past their deadline (each gets a
        timeout), drops the connection once the oldest abandoned one is `DEAD_AFTER_S` overdue, and
        sets itself for the next deadline, the oldest call's still waiting or the drop's."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        oldest = self._waiting[self._abandoned] if self._abandoned < len(self._waiting) else None
        if oldest is not None and not oldest.graced and now - oldest.deadline > self._timeout_s / 2:
            # The timer ran late: the event loop was busy, not Redis. A reply may be unread in the socket
            # (uvloop runs due timers before it polls), or a command may only just have gone out (uvloop
            # writes small writes after the callback that made them). Every call already due gets a whole
            # timeout of loop time from now, once, and together: one by one, each would have found the
            # next one late in turn and a stalled Redis would fail the queue one timeout at a time.
            for waiting in itertools.islice(self._waiting, self._abandoned, None):
                if waiting.deadline > now:
                    break
                waiting.graced = True
                waiting.deadline = now + self._timeout_s
        while self._abandoned < len(self._waiting):
            waiting = self._waiting[self._abandoned]
            if now < waiting.deadline:
                break
            self._abandoned += 1
            if not waiting.future.done():
                waiting.future.set_exception(RedisTimeoutError("Timeout reading from Redis."))
        if self._abandoned and now - self._waiting[0].deadline >= DEAD_AFTER_S:
            self.fail(RedisTimeoutError("Timeout reading from Redis."))
            return
        deadlines = [self._waiting[0].deadline + DEAD_AFTER_S] if self._abandoned else []
        if self._abandoned < len(self._waiting):
            deadlines.append(self._waiting[self._abandoned].deadline)
        if deadlines:
            self._timer = loop.call_at(min(deadlines), self._expire)

    def fail(self, exc: Exception) -> None:
        """Closes the socket; every call still waiting gets `exc`."""
        self.open = False
        self._unsent = []
        self._abandoned = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.abort()
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.future.done():
                waiting.future.set_exception(exc)


class LeanRedis:
    """An asyncio Redis client on one pipelined connection. Replies are bytes (never decoded)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout_s: float = 1.0, unix_path: str | None = None) -> None:
        self._address = (host, port)
        self._unix_path = unix_path
        self._db = db
        self._auth = [username, password] if username and password else [password] if password else []
        self._timeout_s = timeout_s
        self._connection: _Connection | None = None
        self._connecting = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, username: str | None = None,
                 password: str | None = None) -> LeanRedis:
        """`redis://[user[:password]@]host[:port][/db]` or `unix:///path?db=N`; credentials in the URL win.
        No TLS (`rediss://`): redis-py's client (`redis_client`) serves that."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "unix"):
            raise ValueError(f"LeanRedis speaks redis:// and unix://, not {parts.scheme}://")
        user = unquote(parts.username) if parts.username else username
        secret = unquote(parts.password) if parts.password else password
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        if parts.scheme == "unix":
            return cls(db=int(query.get("db", 0)), username=user, password=secret, timeout_s=timeout_s,
                       unix_path=parts.path)
        db = int(parts.path.lstrip("/") or query.get("db", 0))
        return cls(parts.hostname or "127.0.0.1", parts.port or 6379, db=db, username=user, password=secret,
                   timeout_s=timeout_s)

    async def _connect(self) -> _Connection:
        async with self._connecting:
            if self._connection is not None and self._connection.open:
                return self._connection
            loop = asyncio.get_running_loop()
            connection = _Connection(self._timeout_s)
            try:
                async with asyncio.timeout(self._timeout_s):
                    if self._unix_path is not None:
                        await loop.create_unix_connection(lambda: connection, self._unix_path)
                    else:
                        await loop.create_connection(lambda: connection, *self._address)
            except TimeoutError:
                raise RedisTimeoutError("Timeout connecting to Redis.") from None
            except OSError as exc:
                raise RedisConnectionError(f"Error connecting to Redis: {type(exc).__name__}.") from None
            hello = [["AUTH", *self._auth]] if self._auth else []
            hello += [["SELECT", self._db]] if self._db else []
            if hello:
                try:
                    _raise_errors(await connection.send(b"".join(pack(c) for c in hello), len(hello)))
                except Exception as exc:
                    connection.fail(exc)
                    raise
            self._connection = connection
            return connection

    async def round_trip(self, data: bytes, expected: int) -> list[Any]:
        """Sends `data` once more on a fresh connection if the connection broke (not if it timed out: the
        connection is still there, and so would the second try's wait be)."""
        for attempt in (1, 2):
            connection = self._connection
            try:
                if connection is None or not connection.open:
                    connection = await self._connect()
                replies = await connection.send(data, expected)
                if expected == 1:
                    _raise_errors(replies)  # LOADING (a restart) is retried as redis-py does
                return replies
            except _RETRIED:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def execute(self, *args: Arg) -> Any:
        """One command; its reply, or the exception redis-py would raise for it."""
        return (await self.round_trip(pack(args), 1))[0]

    # The commands the stores call, with redis-py's replies.
    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> Any:
        return await self.execute("EVALSHA", sha, numkeys, *keys_and_args)

    async def script_load(self, script: str) -> str:
        return (await self.execute("SCRIPT", "LOAD", script)).decode()

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        flat = await self.execute("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2], strict=True))

    async def get(self, key: str) -> bytes | None:
        return await self.execute("GET", key)

    async def getdel(self, key: str) -> bytes | None:
        return await self.execute("GETDEL", key)

    async def set(self, key: str, value: Arg, *, px: int | None = None, pxat: int | None = None) -> bool:
        return await self.execute(*_set_args(key, value, px, pxat)) == b"OK"

    async def delete(self, *keys: str | bytes) -> int:
        return int(await self.execute("DEL", *keys))

    async def smembers(self, key: str) -> set[bytes]:
        return set(await self.execute("SMEMBERS", key))

    async def scan_iter(self, match: str, count: int = 500) -> AsyncIterator[bytes]:
        cursor = b"0"
        while True:
            cursor, keys = await self.execute("SCAN", cursor, "MATCH", match, "COUNT", count)
            for key in keys:
                yield key
            if cursor == b"0":
                return

    def pipeline(self, transaction: bool = True) -> LeanPipeline:
        return LeanPipeline(self, transaction)

    async def aclose(self) -> None:
        if self._connection is not None:
            self._connection.fail(RedisConnectionError("Client closed."))
            self._connection = None


def _set_args(key: str, value: Arg, px: int | None, pxat: int | None) -> list[Arg]:
    args: list[Arg] = ["SET", key, value]
    if px is not None:
        args += ["PX", px]
    if pxat is not None:
        args += ["PXAT", pxat]
    return args


class LeanPipeline:
    """Commands queued, sent in one write, answered in one round trip; `execute` returns each reply
    (converted as redis-py converts it) and raises the first error, as redis-py's pipeline does. With
    `transaction`, the commands run in MULTI/EXEC: all or nothing."""

    def __init__(self, redis: LeanRedis, transaction: bool) -> None:
        self._redis = redis
        self._transaction = transaction
        self._commands: list[list[Arg]] = []
        self._convert: list[Any] = []

    async def __aenter__(self) -> LeanPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._commands.clear()
        self._convert.clear()

    def _queue(self, convert: Any, *args: Arg) -> LeanPipeline:
        self._commands.append(list(args))
        self._convert.append(convert)
        return self

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> LeanPipeline:
        return self._queue(None, "EVALSHA", sha, numkeys, *keys_and_args)

    def set(self, key: str, value: Arg, *, px: int | None = None, pxat: int | None = None) -> LeanPipeline:
        return self._queue(lambda r: r == b"OK", *_set_args(key, value, px, pxat))

    def hset(self, key: str, *, items: Sequence[Arg]) -> LeanPipeline:
        return self._queue(int, "HSET", key, *items)

    def pexpire(self, key: str, ms: int) -> LeanPipeline:
        return self._queue(bool, "PEXPIRE", key, ms)

    def delete(self, *keys: str | bytes) -> LeanPipeline:
        return self._queue(int, "DEL", *keys)

    def sadd(self, key: str, *members: Arg) -> LeanPipeline:
        return self._queue(int, "SADD", key, *members)

    async def execute(self) -> list[Any]:
        if not self._commands:
            return []
        commands = [["MULTI"], *self._commands, ["EXEC"]] if self._transaction else self._commands
        replies = await self._redis.round_trip(b"".join(pack(c) for c in commands), len(commands))
        if self._transaction:
            _raise_errors(replies[:-1])  # a command refused while queued (EXEC then answers EXECABORT)
            replies = replies[-1]
            if replies is None:
                raise RedisConnectionError("The transaction was discarded.")  # only WATCH does that; none here
        _raise_errors(replies)
        converted = [r if convert is None else convert(r) for convert, r in zip(self._convert, replies, strict=True)]
        self._commands.clear()
        self._convert.clear()
        return converted

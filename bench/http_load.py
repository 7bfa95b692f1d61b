"""Open-loop HTTP load with a lean keep-alive client, so the load generator costs little of the CPU it
shares with the systems under test (an HTTP library's client spends about as much per request as a
proxy does).

`paced_posts()` starts one POST every 1/rate seconds whatever the answers do (open loop: a system that
falls behind sees its queue grow, as it would with real clients) and returns each request's outcome.
Latency runs from the request's scheduled send time, not from when the generator got to send it: a
late generator (the event loop busy, the CPU shared) adds its lag to the figures instead of hiding a
stall of the system under test (coordinated omission).
Responses are HTTP/1.1 with a content length or chunked; connections are kept alive and reused.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    status: int  # 0: no answer (timeout, connection error)
    latency_ms: float  # from the scheduled send time (start + i / rate) to the whole answer, or to the failure
    body: bytes = b""
    error: str = ""  # with status 0: why (the exception's class)


class Pool:
    """Keep-alive connections to one host:port; a request takes an idle one or opens a new one."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n{extra}"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, _, payload = await self.exchange(path, body)
        return status, payload

    async def exchange(self, path: str, body: bytes) -> tuple[int, bytes, bytes]:
        """One POST: (status, the response's head as sent, its body)."""
        reused = False
        while self._idle and not reused:
            reader, writer = self._idle.pop()
            reused = not reader.at_eof()
            if not reused:
                writer.close()  # the server closed it while it was idle (its keep-alive timeout)
        if not reused:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                if not (reused and getattr(exc, "partial", b"") == b""):
                    raise
                # A kept-alive connection the server closed (idle past its timeout) as this request was
                # written: it read nothing of it (a reset says the request was still unread in the
                # server's socket when it closed), so it is sent once more, on a new connection.
                writer.close()
                return await self.exchange(path, body)
            status = int(head[9:12])
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                payload = await _chunked(reader)
            else:
                at = lower.find(b"content-length:")
                length = int(lower[at + 15:lower.find(b"\r\n", at)]) if at >= 0 else 0
                payload = await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        if b"connection: close" in lower:
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, head, payload

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def paced_posts(pool: Pool, path: str, bodies: list[bytes], rate: float, timeout_s: float = 15.0) -> list[Outcome]:
    """POSTs `bodies` at `rate` per second, open loop; each outcome in the order sent."""

    async def one(body: bytes, due: float) -> Outcome:
        try:
            status, payload = await asyncio.wait_for(pool.post(path, body), timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            return Outcome(0, (time.perf_counter() - due) * 1000, error=type(exc).__name__)
        return Outcome(status, (time.perf_counter() - due) * 1000, payload)

    start = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(body, due)))
    return list(await asyncio.gather(*tasks))

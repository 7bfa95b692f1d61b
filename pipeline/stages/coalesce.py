"""Tokens produced close together travel as one chunk message.

Every chunk is a Kafka message produced, acknowledged, consumed and recorded by each stage after the
generation stage: most of a request's cost. `coalesced()` merges the deltas a backend yields within a
short window into one: a streaming answer's first chunk goes alone and at once (time to first token
does not grow), later ones wait at most the window (`runtime.chunk_window_ms`, 5 ms) for more text; a
non-streaming answer waits up to `WHOLE_FACTOR` windows, so a fast backend's whole answer is one
message. A window of 0 sends every delta as its own chunk. A chunk never grows past `MAX_CHUNK_CHARS`.

The backend is read ahead in one task per answer (`_Ahead`), so waiting never cancels its step, and
each delta is stamped with the time it was produced: a chunk's window runs from its first delta's
stamp, so where chunks split depends on when the backend produced its tokens, not on when the sender
came back for them. A retry after a failed send that regenerates the same tokens at the same pace cuts
the same chunks, so emit, which takes a chunk by seq, does not mix one attempt's text with another's (a
stalled sender must not merge the deltas that piled up meanwhile into chunks the first attempt cut
differently). A backend at another pace on the retry may still cut other chunks: postguard and emit
then find the digest chain unlike the chunks they took and end the request `stream_incomplete`
(docs/reliability.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from pipeline.backends.base import Delta

STREAM_WINDOW_S = 0.005  # the default of `runtime.chunk_window_ms`
WHOLE_FACTOR = 200  # a non-streaming answer's window: 1 s by default (progress is recorded per chunk, so a
# takeover repeats at most this much generation)
MAX_CHUNK_CHARS = 16384


def merged(deltas: list[Delta]) -> Delta:
    """One delta for several consecutive ones (the last one's ending and counts)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    ids = tuple(t for d in deltas for t in d.token_ids)
    return Delta("".join(d.text for d in deltas), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens)


class _Ahead:
    """Reads a backend's deltas in one task of its own and stamps each with the loop time it came.
    One task per answer, not one per delta: a backend that has its deltas at hand (the instant
    backend, an upstream's burst read at once) costs no task or loop iteration per delta, and every
    backend step runs in that one task, so a step that spans a wait stays in the task it began in."""

    def __init__(self, deltas: AsyncIterator[Delta]) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: deque[tuple[float, Delta]] = deque()
        self._end: BaseException | None = None  # StopAsyncIteration once the backend finished, or its error
        self._wake: asyncio.Future[None] | None = None
        self._task = asyncio.ensure_future(self._read(deltas))

    async def _read(self, deltas: AsyncIterator[Delta]) -> None:
        try:
            async for delta in deltas:
                self._items.append((self._loop.time(), delta))
                self._notify()
            self._end = StopAsyncIteration()
        except BaseException as exc:  # the backend failed, or this task was cancelled by close()
            self._end = exc
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self, until: float | None = None) -> tuple[float, Delta] | None:
        """The next delta and its stamp; None when the next one was produced after `until` (loop time),
        or none came by then. Raises StopAsyncIteration at the end, or the backend's error after every
        delta before it."""
        if not self._items and self._end is None:
            self._wake = self._loop.create_future()
            timer = self._loop.call_at(until, self._notify) if until is not None else None
            try:
                await self._wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()
        if self._items:
            if until is not None and self._items[0][0] > until:
                return None  # it opens the next chunk
            return self._items.popleft()
        if self._end is not None:
            raise self._end
        return None

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def coalesced(
    deltas: AsyncIterator[Delta], *, streaming: bool, first_alone: bool, window_s: float = STREAM_WINDOW_S,
) -> AsyncIterator[Delta]:
    """`deltas`, merged as the module says. An error from the backend comes after the text before it."""
    if window_s <= 0:
        async for delta in deltas:
            yield delta
        return
    window = window_s if streaming else window_s * WHOLE_FACTOR
    ahead = _Ahead(deltas)
    alone = first_alone and streaming
    try:
        while True:
            try:
                first = await ahead.next()
            except StopAsyncIteration:
                return
            assert first is not None  # no deadline: a delta, the end or an error
            stamp, delta = first
            group, size, failure, ended = [delta], len(delta.text), None, False
            until = stamp + window
            while not alone and group[-1].finish_reason is None and size < MAX_CHUNK_CHARS:
                try:
                    more = await ahead.next(until)
                except StopAsyncIteration:
                    ended = True
                    break
                except BaseException as exc:  # the backend failed or was cancelled: send what came first
                    failure = exc
                    break
                if more is None:
                    break  # the window closed: this chunk goes; the next starts from what came later
                group.append(more[1])
                size += len(more[1].text)
            alone = False
            yield merged(group)
            if failure is not None:
                raise failure
            if ended:
                return
    finally:
        await ahead.close()

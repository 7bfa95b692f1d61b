"""Tokens produced close together travel as one chunk message.

Every chunk is a Kafka message produced, acknowledged, consumed and recorded by each stage after the
generation stage: most of a request's cost. `coalesced()` merges the deltas a backend yields within a
short window into one: a streaming answer's first chunk goes alone and at once (time to first token
does not grow), later ones wait at most the window (`runtime.chunk_window_ms`, 5 ms) for more text; a
non-streaming answer waits up to `WHOLE_FACTOR` windows, so a fast backend's whole answer is one
message. A window of 0 sends every delta as its own chunk. A chunk never
grows past `MAX_CHUNK_CHARS`. Waiting never cancels the backend's step: the next delta is awaited in a
task that the next chunk starts from.
"""

from __future__ import annotations

import asyncio
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


async def coalesced(
    deltas: AsyncIterator[Delta], *, streaming: bool, first_alone: bool, window_s: float = STREAM_WINDOW_S,
) -> AsyncIterator[Delta]:
    """`deltas`, merged as the module says. An error from the backend comes after the text before it."""
    if window_s <= 0:
        async for delta in deltas:
            yield delta
        return
    window = window_s if streaming else window_s * WHOLE_FACTOR
    loop = asyncio.get_running_loop()
    upcoming: asyncio.Future[Delta] | None = None  # the next delta, awaited in a task across chunks
    alone = first_alone and streaming
    try:
        while True:
            try:
                delta = await (upcoming if upcoming is not None else anext(deltas))
            except StopAsyncIteration:
                return
            upcoming = None
            group, size, failure, ended = [delta], len(delta.text), None, False
            deadline = loop.time() + window
            while not alone and group[-1].finish_reason is None and size < MAX_CHUNK_CHARS:
                upcoming = asyncio.ensure_future(anext(deltas))
                done, _ = await asyncio.wait((upcoming,), timeout=max(deadline - loop.time(), 0.0))
                if not done:
                    break  # the window closed: this chunk goes; the next starts from `upcoming`
                step, upcoming = upcoming, None
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    ended = True
                    break
                except BaseException as exc:  # the backend failed or was cancelled: send what came first
                    failure = exc
                    break
                group.append(delta)
                size += len(delta.text)
            alone = False
            yield merged(group)
            if failure is not None:
                raise failure
            if ended:
                return
    finally:
        if upcoming is not None:
            upcoming.cancel()
            await asyncio.gather(upcoming, return_exceptions=True)

"""A job's input file as an async stream of its parsed lines (validation.read_input), read and parsed in a
thread `CHUNK_LINES` at a time, so a job holds those and its lines in flight, never the whole file (parsed,
about 1.2 times its size, for as long as the job ran), however large the file and however many jobs read it.

    with path.open("rb") as source:   # the worker opens it in a thread (worker.py, `_input`)
        async for item in InputLines(source, endpoint, skip=done):   # a Line or a Rejected, in file
            ...                                                     # order, none whose key is in `skip`

Each pass reads the file again (validation once, then each run of the job; a job taken over reads it
from the start): it costs parsing the file again, instead of memory for the job's whole life.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Collection
from typing import BinaryIO

from pipeline.batch.validation import Line, Rejected, read_input

CHUNK_LINES = 32  # lines parsed per trip to a thread (each at most validation.MAX_LINE_BYTES)


class InputLines:
    def __init__(self, source: BinaryIO, endpoint: str, skip: Collection[str] = ()) -> None:
        self._items = read_input(source, endpoint)
        self._skip = skip
        self._ready: deque[Line | Rejected] = deque()

    def __aiter__(self) -> InputLines:
        return self

    async def __anext__(self) -> Line | Rejected:
        while not self._ready:
            chunk = await asyncio.to_thread(list, itertools.islice(self._items, CHUNK_LINES))
            if not chunk:
                raise StopAsyncIteration
            self._ready.extend(item for item in chunk if item.key not in self._skip)
        return self._ready.popleft()


__all__ = ["CHUNK_LINES", "InputLines"]

"""Putting a request's chunks back in order: what emit, postguard and the SDK share.

Chunks of one request can arrive twice (a redelivery, a takeover that regenerates what was already
sent) or early (a fenced worker's chunk overtaking its successor's). `Sequencer.accept` returns the
chunks that are now next in line, each seq once; a chunk above the expected one is held until the
gap fills. `gap()` says whether anything is held: a terminal event that arrives with a gap open
means chunks were lost, and the request ends with `stream_incomplete` instead of a stream with a hole.

A held chunk's message is finished as far as the broker knows (its offset is committed), so a stage
whose successor must go on from where it stopped stores the chunks it holds (emit, postguard) and
hands them to its successor's `accept` before anything else.
"""

from __future__ import annotations

from topics.stream import Chunk

MAX_HELD = 4096  # chunks held for one request; past that the stream is declared broken
MAX_HELD_CHARS = 4 * 1024 * 1024  # and their text: a count alone let 4,096 chunks of a megabyte each be held


class Sequencer:
    __slots__ = ("next_seq", "_held", "_chars")

    def __init__(self, next_seq: int = 0) -> None:
        self.next_seq = next_seq  # the seq the client expects next
        self._held: dict[int, Chunk] = {}
        self._chars = 0  # text held

    def accept(self, chunk: Chunk) -> list[Chunk]:
        """The chunks to release now, in order (empty for a duplicate or an early chunk)."""
        if chunk.seq < self.next_seq or chunk.seq in self._held:
            return []
        if chunk.seq > self.next_seq:
            if len(self._held) >= MAX_HELD or self._chars + len(chunk.text) > MAX_HELD_CHARS:
                raise OverflowError("too many chunks held behind a gap")
            self._held[chunk.seq] = chunk
            self._chars += len(chunk.text)
            return []
        ready = [chunk]
        self.next_seq += 1
        while (following := self._held.pop(self.next_seq, None)) is not None:
            self._chars -= len(following.text)
            ready.append(following)
            self.next_seq += 1
        return ready

    def drop_from(self, seq: int) -> None:
        """Forgets the held chunks numbered `seq` and above: past the end a terminal event counts."""
        for stray in [held for held in self._held if held >= seq]:
            self._chars -= len(self._held.pop(stray).text)

    def holds(self, seq: int) -> bool:
        return seq in self._held

    def gap(self) -> bool:
        return bool(self._held)

    def held(self) -> list[Chunk]:
        """The chunks waiting behind the gap, in order (to carry over when the position is re-read)."""
        return [self._held[seq] for seq in sorted(self._held)]

"""The sequencer emit, postguard and the SDK share: chunks back in order, and a bound on what waits."""

from __future__ import annotations

import pytest

from pipeline.sequencing import MAX_HELD_CHARS, Sequencer
from topics.stream import Chunk


def chunk(seq: int, text: str = "t") -> Chunk:
    return Chunk(id="acme/r1", reply_to="llm.responses.sdk", seq=seq, text=text, tenant="acme")


def test_chunks_come_out_in_order_once_each() -> None:
    order = Sequencer()
    assert order.accept(chunk(1)) == [] and order.gap()
    assert [c.seq for c in order.accept(chunk(0))] == [0, 1] and not order.gap()
    assert order.accept(chunk(1)) == []  # a repeat


def test_what_waits_behind_a_gap_is_bounded_in_text_not_only_in_count() -> None:
    order = Sequencer()
    big = "x" * (1024 * 1024)
    for seq in range(1, MAX_HELD_CHARS // len(big) + 1):
        order.accept(chunk(seq, big))
    with pytest.raises(OverflowError):  # 4,096 chunks of a megabyte each were held before
        order.accept(chunk(MAX_HELD_CHARS // len(big) + 1, big))
    released = order.accept(chunk(0))
    assert len(released) == MAX_HELD_CHARS // len(big) + 1 and not order.gap()
    order.accept(chunk(len(released) + 1, big))  # the count of what is held starts again from nothing


def test_held_chunks_past_an_end_are_dropped_with_their_text() -> None:
    order = Sequencer()
    order.accept(chunk(0))
    for seq in (2, 4, 5):
        order.accept(chunk(seq, "x" * 10))
    order.drop_from(4)
    assert [c.seq for c in order.held()] == [2] and order._chars == 10
    order.drop_from(2)
    assert not order.gap() and order._chars == 0

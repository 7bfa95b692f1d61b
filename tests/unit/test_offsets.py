from pipeline.offsets import OffsetTracker


def test_commits_only_below_the_oldest_unfinished_offset() -> None:
    t = OffsetTracker()
    for off in (10, 11, 12):
        t.start(off)
    t.finish(11)
    t.finish(12)
    assert t.committable() == 10  # 10 is still in flight: nothing at or past it is committed
    t.mark_committed(10)
    t.finish(10)
    assert t.committable() == 13
    t.mark_committed(13)
    assert t.committable() is None and t.in_flight == 0


def test_advances_in_steps_as_messages_finish_in_order() -> None:
    t = OffsetTracker()
    t.start(0)
    t.start(1)
    t.finish(0)
    assert t.committable() == 1
    t.mark_committed(1)
    t.finish(1)
    assert t.committable() == 2

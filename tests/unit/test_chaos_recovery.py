"""The chaos checker's recovery figure: from the end of a fault to each open stream's next event."""

from __future__ import annotations

from tests.chaos.checker import FaultEvent, _recoveries
from tests.chaos.clients import ClientResult
from tests.chaos.scenarios import RequestSpec

SPEC = RequestSpec("n00", 8, 60.0)


def stream(sent: float, arrivals: list[float], ended: float | None) -> ClientResult:
    return ClientResult("s", SPEC, f"r{sent}", sent, [(i, "x", t) for i, t in enumerate(arrivals)], ended_at=ended)


def test_recovery_counts_streams_open_when_the_fault_ended() -> None:
    outage = FaultEvent("broker_outage", None, None, at=10.0, ended=70.0)
    streams = [
        stream(5.0, [6.0, 7.0, 74.5, 75.0], 76.0),  # mid-stream through the outage: next chunk 4.5 s after
        stream(20.0, [], 81.0),  # sent during it, answered at once, with its terminal only: 11 s after
        stream(1.0, [2.0], 3.0),  # over before the fault
        stream(71.0, [72.0], 73.0),  # sent after it
    ]
    assert sorted(_recoveries(streams, [outage])) == [4.5, 11.0]

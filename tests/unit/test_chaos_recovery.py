"""The chaos checker's recovery figure: from the end of a fault to each open stream's next event; which
scenarios its takeover stall bound holds."""

from __future__ import annotations

from tests.chaos.checker import FaultEvent, _recoveries, stall_bounded
from tests.chaos.clients import ClientResult
from tests.chaos.scenarios import WHOLE, RequestSpec

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


def test_the_stall_bound_holds_kills_of_stages_that_load_no_model() -> None:
    def kill(stage: str) -> FaultEvent:
        return FaultEvent("kill", stage, 1, at=1.0, ended=1.1)

    assert stall_bounded([kill("decode"), kill("emit")], ())
    assert not stall_bounded([kill("decode"), kill("guard")], ())  # a guard's replacement loads models
    assert stall_bounded([kill(WHOLE)], ("ingest", "decode", "emit"))  # processes
    assert not stall_bounded([kill(WHOLE)], ("ingest", "guard", "decode", "postguard", "emit"))  # processes-guarded
    assert not stall_bounded([kill("decode"), FaultEvent("broker_restart", None, None, at=2.0, ended=9.0)], ())
    assert not stall_bounded([], ())

"""`tracing.extract` on headers a hostile producer can send: it never raises and ignores what it cannot use."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry import trace

from pipeline import tracing

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _trace_id(headers: Any) -> int:
    return trace.get_current_span(tracing.extract(headers)).get_span_context().trace_id


def test_reads_a_valid_traceparent() -> None:
    assert _trace_id([("traceparent", TRACEPARENT)]) == TRACE_ID
    assert _trace_id([("traceparent", TRACEPARENT), ("tracestate", b"vendor=value")]) == TRACE_ID


@pytest.mark.parametrize(
    "header",
    [
        ("traceparent", None),
        ("traceparent", b"x" * 100_000),
        ("traceparent", TRACEPARENT + b" " * (tracing.MAX_HEADER_BYTES - len(TRACEPARENT) + 1)),
        ("traceparent", b"\xff\xfe"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),  # a str, not bytes
        ("traceparent", "é".encode()),
        ("traceparent", 7),
        ("traceparent", b"garbage"),
        (None, TRACEPARENT),
        (b"traceparent", TRACEPARENT),
        (7, TRACEPARENT),
    ],
    ids=["none", "huge", "over-limit", "binary", "str", "non-ascii", "int", "garbage", "key-none", "key-bytes",
         "key-int"],
)
def test_ignores_a_header_it_cannot_use(header: tuple[Any, Any]) -> None:
    assert _trace_id([header]) == 0  # no remote parent: the span starts a new trace


@pytest.mark.parametrize(
    "tracestate",
    [None, b"\xff\xfe", b"x" * 100_000, b"=" * 600, b"a=" + bytes(range(32))],
    ids=["none", "binary", "huge", "equals", "controls"],
)
def test_a_bad_tracestate_leaves_the_traceparent_usable(tracestate: Any) -> None:
    assert _trace_id([("traceparent", TRACEPARENT), ("tracestate", tracestate)]) == TRACE_ID


@pytest.mark.parametrize(
    "tracestate",
    [b"x\nFORGED", b"ok=1,x\nFORGED=2", b"a=FORGED\r\nb=c", b"k=v\n2025-01-01 ERROR FORGED", b"A=FORGED",
     b",".join(b"k%d=FORGED" % n for n in range(33))],
    ids=["newline", "second-member", "crlf", "forged-line", "upper-key", "33-members"],
)
def test_a_bad_tracestate_is_dropped_without_logging_it(tracestate: bytes, caplog: pytest.LogCaptureFixture) -> None:
    # opentelemetry's parser logs each member it refuses, newline and all: a producer could forge log lines
    caplog.set_level(logging.DEBUG)
    span_context = trace.get_current_span(tracing.extract([("traceparent", TRACEPARENT), ("tracestate", tracestate)]))
    assert span_context.get_span_context().trace_id == TRACE_ID
    assert len(span_context.get_span_context().trace_state) == 0
    assert not [r for r in caplog.records if "FORGED" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tracestate_of_32_members_is_kept() -> None:
    state = b",".join(b"k%d=v" % n for n in range(32))
    headers = [("traceparent", TRACEPARENT), ("tracestate", state)]
    assert len(trace.get_current_span(tracing.extract(headers)).get_span_context().trace_state) == 32


@pytest.mark.parametrize(
    "headers",
    [None, [], [None], [("traceparent",)], [("traceparent", TRACEPARENT, b"x")], [[]], 7, "traceparent", [1, 2, 3]],
    ids=["none", "empty", "none-item", "one-tuple", "three-tuple", "empty-list", "int", "str", "ints"],
)
def test_malformed_header_lists_give_no_parent(headers: Any) -> None:
    assert _trace_id(headers) == 0


def test_a_header_list_that_fails_to_iterate_gives_no_parent() -> None:
    class Broken:
        def __iter__(self) -> Any:
            raise RuntimeError("boom")

    assert _trace_id(Broken()) == 0


def _tracestate_of(size: int) -> bytes:
    """A valid tracestate of exactly `size` bytes (up to ~520): two members, values under W3C's 256."""
    first = "a=" + "v" * 254
    state = f"{first},b={'w' * (size - len(first) - 3)}".encode()
    assert len(state) == size
    return state


def test_accepts_a_value_at_the_size_limit_and_not_past_it() -> None:
    def state(size: int) -> Any:
        headers = [("traceparent", TRACEPARENT), ("tracestate", _tracestate_of(size))]
        return trace.get_current_span(tracing.extract(headers)).get_span_context().trace_state

    assert len(state(tracing.MAX_HEADER_BYTES)) > 0
    assert len(state(tracing.MAX_HEADER_BYTES + 1)) == 0


_W3C = [
    TRACEPARENT, b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", b"  " + TRACEPARENT + b" ",
    b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
    b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01", b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01",
    b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-ff", b"0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
]


@pytest.mark.parametrize("traceparent", _W3C)
@pytest.mark.parametrize("tracestate", [None, b"vendor=value,other=x", b"not a tracestate"])
def test_reads_what_opentelemetrys_propagator_reads(traceparent: bytes, tracestate: bytes | None) -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent.decode()} | ({"tracestate": tracestate.decode()} if tracestate else {})
    headers = [("traceparent", traceparent)] + ([("tracestate", tracestate)] if tracestate else [])
    theirs = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
    ours = trace.get_current_span(tracing.extract(headers)).get_span_context()
    assert ours == theirs
    assert (ours.trace_flags, ours.trace_state, ours.is_remote) == (theirs.trace_flags, theirs.trace_state, theirs.is_remote)
    if ours.is_valid:  # and what it reads, it writes back as the propagator does
        written: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(written, context=tracing.extract(headers))
        assert tracing.inject(tracing.extract(headers)) == [(k, v.encode()) for k, v in written.items()]

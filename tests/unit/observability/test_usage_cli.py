"""`sluice usage`: durations, and sums over a tenant's usage records (the Kafka side runs in
tests/integration/test_observability_usage.py)."""

from __future__ import annotations

import argparse

import pytest

from pipeline.observability.usage_cli import duration, render, summarise
from topics.usage import UsageRecord


def record(tenant: str, at: float, model: str = "m", outcome: str = "stop", cost: float = 0.5) -> UsageRecord:
    return UsageRecord(id=f"{tenant}/{at}", tenant=tenant, model=model, outcome=outcome, prompt_tokens=10,
                       completion_tokens=20, total_ms=5.0, timings={}, at=at, cost=cost)


def test_durations() -> None:
    assert duration("90s") == 90 and duration("15m") == 900 and duration("1h") == 3600 and duration("7d") == 604800
    assert duration("30") == 30
    with pytest.raises(argparse.ArgumentTypeError):
        duration("an hour")


def test_summarise_counts_only_the_tenant_since() -> None:
    records = [record("acme", 100), record("acme", 200, outcome="rate_limited", cost=0.0), record("acme", 50),
               record("other", 200), record("acme", 300, model="n")]
    by_model = summarise(records, "acme", since=100)
    assert set(by_model) == {"m", "n"}
    assert by_model["m"].requests == 2 and by_model["m"].cost == pytest.approx(0.5)
    assert dict(by_model["m"].outcomes) == {"stop": 1, "rate_limited": 1}
    table = render("acme", 3600, by_model)
    assert table.splitlines()[-1].split()[:2] == ["total", "3"]


def test_render_escapes_control_characters_in_what_a_record_carries() -> None:
    """A model string with an escape sequence, a carriage return and a newline rewrote the terminal's line
    and printed a forged row. Emit now writes "other" for an unconfigured model; this is the second line."""
    forged = "\x1b[2K\rgpt-4o 1 0 0 0.0\nFORGED"
    table = render("acme\r", 3600, summarise([record("acme\r", 100, model=forged, outcome="x\ty")], "acme\r", since=0))
    assert not any(c in table for c in "\x1b\r\t") and table.count("\n") == 3
    assert "\\x1b[2K\\rgpt-4o 1 0 0 0.0\\nFORGED" in table and "x\\ty=1" in table and "acme\\r" in table

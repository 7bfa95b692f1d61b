"""The guards load and run with no network: nothing is downloaded at start-up or on first use."""

from __future__ import annotations

from pipeline.guard.loader import InputGuard, TextCheck
from tests.unit.guard.conftest import NoNetwork


def test_guards_load_and_run_without_touching_the_network(no_network: NoNetwork, input_guard: InputGuard, make_output_guard) -> None:  # type: ignore[no-untyped-def]
    [[verdict]] = input_guard.check([[TextCheck("Mail jane.doe@example.org about the invoice.", True)]])
    assert [f.entity for f in verdict.findings] == ["EMAIL"]  # the e-mail check reads tldextract's snapshot
    make_output_guard()
    assert no_network.attempts == []

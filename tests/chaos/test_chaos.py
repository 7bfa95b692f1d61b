"""The chaos profiles as tests: `short`, `output-guard`, `input-guard` and `processes` run in `make test`
(about 2-3 minutes each), `full`, `full-guarded` and `processes-guarded` under `make chaos`."""

from __future__ import annotations

import asyncio

import pytest

from tests.chaos.run import run_profile
from tests.chaos.scenarios import PROFILES


def _run(name: str) -> None:
    report = asyncio.run(run_profile(PROFILES[name]))
    print(report.markdown())
    assert report.error is None, report.markdown()
    assert report.ok, report.markdown()
    if PROFILES[name].repeat_after:  # its repeated requests exercised the cache's path (hits handed to emit)
        assert all(s.cache_hits for s in report.scenarios), report.markdown()


def test_short_profile() -> None:
    _run("short")


def test_output_guard_profile() -> None:
    _run("output-guard")


def test_input_guard_profile() -> None:
    _run("input-guard")


def test_processes_profile() -> None:
    _run("processes")


@pytest.mark.chaos
def test_full_profile() -> None:
    _run("full")


@pytest.mark.chaos
def test_full_guarded_profile() -> None:
    _run("full-guarded")


@pytest.mark.chaos
def test_processes_guarded_profile() -> None:
    _run("processes-guarded")

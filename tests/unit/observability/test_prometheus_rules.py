"""infra/prometheus: the scrape config and the rules pass promtool's checks, and each alert fires on the
series it is meant for and not on its near miss (promtool's rule unit tests, infra/prometheus/tests.yml)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

PROMETHEUS = Path(__file__).resolve().parents[3] / "infra" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=PROMETHEUS, timeout=300)


@pytest.mark.parametrize("args", [("check", "config", "prometheus.yml"), ("check", "rules", "rules/sluice.rules.yml")])
def test_promtool_checks_pass(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_test_that_fires_it() -> None:
    rules = (PROMETHEUS / "rules" / "sluice.rules.yml").read_text()
    tests = (PROMETHEUS / "tests.yml").read_text() + (PROMETHEUS / "tests-cost.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if line.strip().startswith("- alert:")]
    assert len(alerts) >= 9
    untested = [a for a in alerts if f"alertname: {a}" not in tests and a != "SluiceTargetDown"]  # `up` needs a scrape
    assert not untested, untested


def test_alerts_fire_on_their_series() -> None:
    result = promtool("test", "rules", "tests.yml", "tests-cost.yml")
    assert result.returncode == 0, result.stdout + result.stderr

"""infra/prometheus: the scrape config and the rules pass promtool's checks, and each alert fires on the
series it is meant for and not on its near miss (promtool's rule unit tests, infra/prometheus/tests.yml)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[3] / "infra" / "prometheus"
RULES = "rules/sluice.rules.yml"
TESTS = ("tests.yml", "tests-cost.yml")  # promtool's rule unit tests


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=PROMETHEUS, timeout=300)


@pytest.mark.parametrize("args", [("check", "config", "prometheus.yml"), ("check", "rules", RULES)])
def test_promtool_checks_pass(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_test_that_fires_it() -> None:
    """Fires: a test case expects at least one alert of that name (`exp_alerts: []` checks only silence)."""
    rules = yaml.safe_load((PROMETHEUS / RULES).read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert len(alerts) >= 9, alerts
    fired = {
        case["alertname"]
        for name in TESTS
        for test in yaml.safe_load((PROMETHEUS / name).read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    untested = [a for a in alerts if a not in fired]
    assert not untested, untested


def test_alerts_fire_on_their_series() -> None:
    result = promtool("test", "rules", *TESTS)
    assert result.returncode == 0, result.stdout + result.stderr

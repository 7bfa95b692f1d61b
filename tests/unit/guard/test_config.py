"""[guard] settings: validated once, per-tenant policy falls back to the defaults."""

from __future__ import annotations

import pytest

from pipeline.guard.config import GuardSettings, TenantGuard
from pipeline.settings import Settings, SettingsError


def test_tenant_policy_overrides_the_defaults_entity_by_entity() -> None:
    guard = GuardSettings(pii={"EMAIL": "allow"}, tenants={"acme": TenantGuard(pii={"PERSON": "block"}, injection_threshold=0.2)})
    assert guard.policy("acme")["EMAIL"] == "allow" and guard.policy("acme")["PERSON"] == "block"
    assert guard.policy("other")["PERSON"] == "allow"
    assert guard.injection_threshold_for("acme") == 0.2 and guard.injection_threshold_for("other") == guard.injection_threshold == 0.8


@pytest.mark.parametrize(
    ("guard", "problem"),
    [
        (GuardSettings(pii={"EMAILS": "redact"}), "unknown entity"),
        (GuardSettings(injection_threshold=1.5), "between 0 and 1"),
        (GuardSettings(tenants={"t": TenantGuard(injection_threshold=-0.1)}), "between 0 and 1"),
        (GuardSettings(holdback_tokens=0), "holdback_tokens"),
        (GuardSettings(blocklist=("(unclosed",)), "not a regular expression"),
        (GuardSettings(toxicity_backend="detoxify"), "detoxify_checkpoint"),
    ],
)
def test_bad_settings_are_refused_at_start_up(guard: GuardSettings, problem: str) -> None:
    with pytest.raises(SettingsError, match=problem):
        Settings(guard=guard).validate()

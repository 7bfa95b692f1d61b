"""`[guard]` in sluice.toml: PII policy per tenant and entity, injection thresholds, the output
holdback window, the blocklist, the toxicity backend and the topics each route serves. Read once by `pipeline.settings.load()` and
validated there (`problems()`); no model is loaded to validate it."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from pipeline.guard.entities import DEFAULT_POLICY, ENTITIES, Action
from pipeline.guard.on_topic import RouteTopics


@dataclass(frozen=True)
class TenantGuard:
    """What one tenant changes; anything left out falls back to the [guard] defaults."""

    pii: dict[str, Action] = field(default_factory=dict)  # entity -> action, over [guard.pii]
    injection_threshold: float | None = None


@dataclass(frozen=True)
class GuardSettings:
    pii: dict[str, Action] = field(default_factory=lambda: dict(DEFAULT_POLICY))  # entity -> action
    pii_min_score: float = 0.4  # Presidio findings below this score are ignored
    injection_threshold: float = 0.8  # classifier probability at or above which a prompt is refused
    tenants: dict[str, TenantGuard] = field(default_factory=dict)
    # postguard holds this many chunks back while it checks them, and at least 4 characters for each (64),
    # and an entity-shaped run (a card number, a key) reaching the release point from its start (stream_check.py)
    holdback_tokens: int = 16
    blocklist: tuple[str, ...] = ()  # regular expressions (case-insensitive) that end a stream
    # "minilm": a head over the MiniLM embedding, max'd with alt-profanity-check (toxicity.py); needs the model
    # cache. Not the default: it ends about one ordinary answer in 25 (docs/guardrails.md)
    toxicity_backend: Literal["profanity_check", "minilm", "detoxify"] = "profanity_check"
    toxicity_threshold: float = 0.8  # per-sentence score at or above which a stream is ended
    detoxify_checkpoint: str = ""  # a local Detoxify checkpoint (.ckpt); required for "detoxify"
    detoxify_config_dir: str = ""  # its Hugging Face config and tokenizer, for loading with no network
    routes: dict[str, RouteTopics] = field(default_factory=dict)  # model -> the topics it serves (on_topic.py)
    # Pieces of text whose verdicts a guard process remembers by digest, so earlier turns of a chat and
    # repeated prompts are not screened again (guard/memo.py); 0 screens every piece every time.
    verdict_memo: int = 20000

    def policy(self, tenant: str) -> dict[str, Action]:
        override = self.tenants.get(tenant)
        return {**DEFAULT_POLICY, **self.pii, **(override.pii if override else {})}

    def injection_threshold_for(self, tenant: str) -> float:
        override = self.tenants.get(tenant)
        if override is not None and override.injection_threshold is not None:
            return override.injection_threshold
        return self.injection_threshold

    def problems(self, models: Collection[str] | None = None) -> list[str]:
        """`models`: the configured ones, which every route must name (a route keyed by a typo leaves the
        model it meant unguarded by topic); None: not checked."""
        found: list[str] = []
        if models is not None and (unknown := sorted(set(self.routes) - set(models))):
            found.append(f"guard.routes: {unknown} are not configured models ({', '.join(models)})")
        policies = {"guard.pii": self.pii, **{f"guard.tenants.{t}.pii": v.pii for t, v in self.tenants.items()}}
        for where, policy in policies.items():
            found += [f"{where}: unknown entity {e!r} (known: {', '.join(ENTITIES)})" for e in policy if e not in ENTITIES]
        thresholds = {"guard.injection_threshold": self.injection_threshold, "guard.pii_min_score": self.pii_min_score,
                      "guard.toxicity_threshold": self.toxicity_threshold}
        thresholds |= {f"guard.tenants.{t}.injection_threshold": v.injection_threshold for t, v in self.tenants.items()
                       if v.injection_threshold is not None}
        for model, route in self.routes.items():
            thresholds |= {f"guard.routes.{model}.threshold": route.threshold, f"guard.routes.{model}.prompt_threshold": route.prompt_threshold}
            if not route.topics or any(not t.strip() for t in route.topics):
                found.append(f"guard.routes.{model}.topics must name at least one topic, each a non-empty sentence")
        found += [f"{name} must be between 0 and 1, got {value}" for name, value in thresholds.items() if not 0.0 <= value <= 1.0]
        if self.verdict_memo < 0:
            found.append(f"guard.verdict_memo must be 0 (off) or positive, got {self.verdict_memo}")
        if self.holdback_tokens < 1:
            found.append(f"guard.holdback_tokens must be at least 1, got {self.holdback_tokens}")
        for pattern in self.blocklist:
            try:
                re.compile(pattern)
            except re.error as exc:
                found.append(f"guard.blocklist: {pattern!r} is not a regular expression ({exc})")
        if self.toxicity_backend == "detoxify" and not self.detoxify_checkpoint:
            found.append("guard.toxicity_backend = 'detoxify' needs guard.detoxify_checkpoint (a local file)")
        return found

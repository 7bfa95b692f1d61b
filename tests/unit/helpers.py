"""Builders for the messages unit tests feed to handlers."""

from __future__ import annotations

import time

from pipeline.settings import Settings
from topics.envelope import Envelope, Route
from topics.requests import ChatMessage, Request, Sampling

SETTINGS = Settings()
MODEL = SETTINGS.models[0]


def request(rid: str = "r1", **overrides: object) -> Request:
    fields: dict[str, object] = {
        "id": rid,
        "reply_to": "llm.responses.sdk",
        "model": MODEL,
        "created_at": time.time(),
        "messages": (ChatMessage(role="user", content="hello there"),),
        "sampling": Sampling(max_tokens=8),
    }
    fields.update(overrides)
    return Request(**fields)  # type: ignore[arg-type]


def routed(req: Request) -> Envelope:
    return Envelope(request=req, principal="default", admitted_at=time.time(), route=Route("local", "local"), timings={"ingest": 0.1})

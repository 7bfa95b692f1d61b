"""Builders for the messages unit tests feed to handlers."""

from __future__ import annotations

import time

from pipeline.settings import Settings
from pipeline.topology import Node, graph
from topics.hops import Admitted, Route, Routed, request_key
from topics.requests import ChatMessage, Request, Sampling

SETTINGS = Settings()
MODEL = SETTINGS.models[0]
NODES = {n.kind: n for n in graph(SETTINGS.stages, SETTINGS.pools)}


def node(kind: str) -> Node:
    """The default (guarded) profile's node of this kind: its name and topics."""
    return NODES[kind]


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


def admitted(req: Request, tenant: str = "default") -> Admitted:
    return Admitted(
        id=request_key(tenant, req.id), request=req, tenant=tenant, principal=tenant, admitted_at=time.time(),
        timings={"ingest": 0.1},
    )


def routed(req: Request, tenant: str = "default") -> Routed:
    a = admitted(req, tenant)
    return Routed(id=a.id, request=req, tenant=tenant, principal=tenant, admitted_at=a.admitted_at, timings=a.timings,
                  route=Route("local", "local"))

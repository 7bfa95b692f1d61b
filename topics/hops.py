"""The request as it travels between stages: one struct per hop, every field set by the hop's writer.

    llm.admitted, llm.screened  Admitted    ingest, then guard (sanitised prompt)
    llm.guarded                 Admitted    the cache's misses (with the ticket emit stores the answer under)
    llm.routed.<pool>           Routed      route: the chosen backend and its fallbacks
    llm.prefilled.<pool>        Prefilled   prefill: the KV handle and the first token

`id` is the request id every stage, store and reply event keys on. Ingest mints it from the
authenticated tenant and the client's id (`request_key`), so a client-chosen id can neither skip a
limit (a new id is a new request) nor touch another tenant's request. `request` is what the client
sent, without its credential. Each stage copies the hop forward with what it added and its own time in
`timings` (stage name -> milliseconds in the handler).
"""

from __future__ import annotations

import msgspec

from topics.cache import Ticket
from topics.requests import Request


def request_key(tenant: str, client_id: str) -> str:
    """The pipeline's id for a client's request: namespaced by the authenticated tenant."""
    return f"{tenant}/{client_id}"


def client_id_of(request_id: str) -> str:
    """The id the client chose, from the pipeline's id (or the id itself before ingest namespaced it)."""
    return request_id.rpartition("/")[2]


class Route(msgspec.Struct, frozen=True):
    backend: str  # a backend name from the config file
    pool: str  # names the topics `llm.routed.<pool>` and `llm.prefilled.<pool>` of this backend's workers
    fallbacks: tuple[str, ...] = ()


class Prefill(msgspec.Struct, frozen=True):
    handle: str  # KV state in the prefill worker's backend; decode recomputes it if it cannot reach it
    first_token_id: int
    first_text: str
    prompt_tokens: int
    worker: str  # which prefill worker holds `handle`


class Admitted(msgspec.Struct, frozen=True, tag="admitted.v2", tag_field="kind"):
    id: str  # request_key(tenant, request.id)
    request: Request  # the client's request, credential removed; guard replaces its text when it redacts
    tenant: str  # the authenticated tenant (never the client's claim)
    principal: str  # "key:<id>", "jwt:<sub>" or "anonymous"
    admitted_at: float
    timings: dict[str, float] = {}
    cache: Ticket | None = None  # set by the cache stage on a miss it may store (emit stores the answer)


class Routed(Admitted, frozen=True, kw_only=True, tag="routed.v2"):
    route: Route


class Prefilled(Routed, frozen=True, kw_only=True, tag="prefilled.v2"):
    prefill: Prefill


Hop = Admitted | Routed | Prefilled


def forward(hop: Admitted, into: type[Routed] | type[Prefilled], **added: object) -> Routed | Prefilled:
    """`hop` as the next hop's struct, with the fields the stage added."""
    fields = {f: getattr(hop, f) for f in hop.__struct_fields__}
    return into(**{**fields, **added})

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

The id and the timings are bounded by the schema (`RequestId`, `Timings`), as on the stream topics: they go
into log lines, span attributes, usage records and the dashboard, and anyone who can write to an internal
topic could put a megabyte or a forged log line there. A record past them is unreadable: dead-lettered
like any schema error.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from topics.cache import Ticket
from topics.requests import MAX_TENANT_CHARS, Request

# A tenant as `pipeline.gateway.keys.tenant_name` admits one (printable, no "/" nor whitespace). A regex
# cannot say "printable": this one leaves out whitespace (line breaks included), the control characters
# (C0 and C1: terminal escapes) and Unicode's invisible format characters (Cf: zero widths, bidirectional
# marks and overrides, the byte order mark, tags), which hide or reorder text in a log line. Every
# character `tenant_name` admits is kept (tests/unit/test_topic_bounds.py checks both ways).
_TENANT_CHAR = (r"[^/\s\x00-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
                r"\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
                r"\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e007f]")
MAX_CLIENT_ID_CHARS = 64  # Request.id's limit
# The pipeline's id, `<tenant>/<client id>` (`request_key`), or a client's bare id (`Request.id`'s rule:
# a refusal before ingest namespaced it, a cancellation by the client's id).
REQUEST_ID = rf"^(?:{_TENANT_CHAR}{{1,{MAX_TENANT_CHARS}}}/)?[A-Za-z0-9._:-]{{1,{MAX_CLIENT_ID_CHARS}}}\Z"
MAX_REQUEST_ID_CHARS = MAX_TENANT_CHARS + 1 + MAX_CLIENT_ID_CHARS
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID)]
# Stage name -> milliseconds. A stage's name (`pipeline.topology`: `ingest`, `decode.<pool>`, at most 57
# characters) or emit's `total`; a request passes about ten stages, so 32 leaves room for fallbacks and
# takeovers. Each stage adds its own: a forged record just under the bound is unreadable a stage or two
# later instead of at once. No pattern on the names: a regex costs about 0.45 us a key at every decode,
# and no log line prints them (usage records and the dashboard carry them as JSON).
MAX_TIMINGS = 32
TimingKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Timings = Annotated[dict[TimingKey, float], msgspec.Meta(max_length=MAX_TIMINGS)]


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
    id: RequestId  # request_key(tenant, request.id)
    request: Request  # the client's request, credential removed; guard replaces its text when it redacts
    tenant: str  # the authenticated tenant (never the client's claim)
    principal: str  # "key:<id>", "jwt:<sub>" or "anonymous"
    admitted_at: float
    timings: Timings = {}
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

"""The graph as data: which stages a deployment runs, and which topics each one reads and writes.

    ingest -> llm.admitted -> guard -> llm.screened -> cache -> llm.guarded -> route -> llm.routed.<pool>
    -> prefill.<pool> -> llm.prefilled.<pool> -> decode.<pool> -> llm.tokens -> postguard -> llm.checked
    -> emit -> llm.responses.<name>

    cache hits -> llm.checked (what is stored already passed postguard); emit -> llm.cache.entries -> cache

`STAGES` is the table: each kind of stage and the topic it reads. A profile (`[profiles]` in
sluice.toml) is a list of kinds; `graph()` wires it: a stage forwards to the input topic of the next
stage of its part of the chain, so leaving guard out makes ingest write `llm.guarded`, and leaving
postguard out makes decode write `llm.checked`. Generation stages are per pool (`prefill.local`,
`decode.local`, or `generate.<pool>` for a backend without the prefill/decode split): each pool has
its own topics and consumer groups. Stages receive their `Topics`;
none names a topic of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from topics import registry

REQUEST_PART = ("ingest", "guard", "cache", "route")  # the request before a backend is chosen, in order
POOL_PART = ("prefill", "decode")  # one of each per pool whose backend splits them
GENERATE = "generate"  # instead, for a pool whose backend cannot split (Triton, an OpenAI-compatible server)
STREAM_PART = ("postguard", "emit")  # the token stream on its way to the client
# The stages a message may be handed to in memory by a stage of the same process (`runtime.handover`):
# they keep no per-request state in memory and no order, so who calls them does not matter.
HANDOVER = frozenset(REQUEST_PART[1:])
# And by kind of taker, from the kinds named only:
# - emit, from the kinds that write a request's whole stream from one message: cache (a hit's replay)
#   and generate (a backend without the prefill/decode split). Nothing else of such a request reaches
#   llm.checked, so no order of emit's partition is at stake; a crash redoes the sender's record, as it
#   redoes any work handed over, and emit's stored progress keeps the client's copy whole. Not prefill
#   and decode: a split stream's first chunk comes from prefill and the rest from decode, often in two
#   processes, and one request's stream must reach one emit at a time.
# - generate, from route: it keeps no order, and what it keeps of a request is under the request's own
#   id and its ownership in the store, as when its topic delivers the message. A crash or a revocation
#   redoes the chain from ingest's record, and the generate stage that meets the request then takes it
#   over as it takes over any redelivered message (resume, or its recorded ending sent again).
#   Not prefill: the split pools' prefill hands its work to decode through the broker anyway.
HANDOVER_FROM = {"emit": frozenset({"cache", GENERATE}), GENERATE: frozenset({"route"})}
KINDS = REQUEST_PART + POOL_PART + (GENERATE,) + STREAM_PART
REQUIRED = frozenset({"ingest", "route", "prefill", "decode", "emit"})

# The topic each kind reads (per pool for the generation stages).
_INPUT: dict[str, str] = {
    "ingest": registry.REQUESTS,
    "guard": registry.ADMITTED,
    "cache": registry.SCREENED,
    "route": registry.GUARDED,
    "postguard": registry.TOKENS,
    "emit": registry.CHECKED,
}


@dataclass(frozen=True)
class Topics:
    """A stage's topics by role."""

    inputs: tuple[str, ...]
    forward: str | None  # where the request goes on; None: per message (route: `pools`; emit: reply_to)
    stream: str | None  # where its chunks and terminal events go; None: the request's own reply topic
    control: str = registry.CONTROL  # cancellations: decode reads them, postguard writes them
    usage: str = registry.USAGE  # emit: one record per finished request
    pools: Mapping[str, str] = field(default_factory=dict)  # route only: pool -> llm.routed.<pool>
    table: str | None = None  # a compacted topic: llm.cache.entries (the cache reads it, emit writes it),
    # llm.backend.health (route reads it)


@dataclass(frozen=True)
class Node:
    name: str  # the stage's consumer group, span name, metric label and log field
    kind: str  # its row in the table
    topics: Topics
    pool: str | None = None  # the backend pool of a generation stage


def input_of(kind: str, pool: str | None = None) -> str:
    if kind == "prefill":
        return registry.routed_topic(pool or "")
    if kind == "decode":
        return registry.prefilled_topic(pool or "")
    return _INPUT[kind]


def check_profile(kinds: tuple[str, ...]) -> list[str]:
    """What is wrong with a profile (empty when it can run)."""
    problems = [f"unknown stage {k!r}" for k in kinds if k not in KINDS or k == GENERATE]
    if missing := sorted(REQUIRED - set(kinds)):
        problems.append(f"missing stages {missing}")
    if len(set(kinds)) != len(kinds):
        problems.append("a stage is listed twice")
    return problems


def graph(kinds: tuple[str, ...], pools: tuple[str, ...], unsplit: frozenset[str] = frozenset()) -> list[Node]:
    """The nodes of a deployment running `kinds` (in any order) with these backend pools; the pools in
    `unsplit` get one `generate.<pool>` stage where the others get `prefill.<pool>` and `decode.<pool>`."""
    request = [k for k in REQUEST_PART if k in kinds]
    stream = [k for k in STREAM_PART if k in kinds]
    first_stream = input_of(stream[0])
    nodes: list[Node] = []
    cached = "cache" in kinds
    table = registry.CACHE_ENTRIES if cached else None
    for i, kind in enumerate(request[:-1]):
        if kind == "cache":  # a hit is replayed straight to emit: what is stored already passed postguard
            topics = Topics((input_of(kind),), input_of(request[i + 1]), input_of(stream[-1]), table=table)
        else:
            topics = Topics((input_of(kind),), input_of(request[i + 1]), first_stream)
        nodes.append(Node(kind, kind, topics))
    routes = {p: registry.routed_topic(p) for p in pools}
    nodes.append(Node("route", "route", Topics((registry.GUARDED,), None, first_stream, pools=routes, table=registry.HEALTH)))
    for pool in pools:
        if pool in unsplit:
            nodes.append(Node(f"{GENERATE}.{pool}", GENERATE, Topics((routes[pool],), first_stream, first_stream), pool))
            continue
        nodes.append(Node(f"prefill.{pool}", "prefill", Topics((routes[pool],), registry.prefilled_topic(pool), first_stream), pool))
        nodes.append(Node(f"decode.{pool}", "decode", Topics((registry.prefilled_topic(pool),), first_stream, first_stream), pool))
    for i, kind in enumerate(stream):
        after = input_of(stream[i + 1]) if i + 1 < len(stream) else None
        nodes.append(Node(kind, kind, Topics((input_of(kind),), after, after, table=table if kind == "emit" else None)))
    return nodes


def select(nodes: list[Node], names: list[str]) -> list[Node]:
    """The nodes a process runs: by kind (`decode`: every pool's) or by name (`decode.local`)."""
    chosen = [n for n in nodes if n.kind in names or n.name in names]
    unknown = [name for name in names if not any(name in (n.kind, n.name) for n in nodes)]
    if unknown:
        raise LookupError(f"not in this deployment's profile: {', '.join(unknown)}")
    return chosen

"""cache: answers a request from a stored answer when it may, else sends it on to route with a ticket
under which emit stores the finished answer (topics.cache).

It sits after the input guard (a refused prompt is never answered from the cache) and before route.
A hit is replayed at once as the stored chunks, same boundaries, each and the `Done` marked with the
tier, straight to emit's input, in one record batch (`Out.with_next`) where they fit: what was stored
had already passed postguard. Exact tier first (Redis, `keys.exact_key`), then the semantic tier (this
worker's per-tenant index, fed by the runner with every record of `llm.cache.entries` from the start:
`on_table`).

Not cached: tenants or models the config turns off, temperature > 0 without a seed (unless the tenant
opts in), `no_cache` requests are not answered from it and `no_store` ones not stored. Redis away: the
exact tier answers nothing (a miss), never an error. An entry of another tenant or model than the
request's is never served, whichever tier finds it (the keys and the per-tenant index make that
impossible; this is the second lock, since what emit stores comes off a topic).

One decision per request (`_follow`): a request that reads the cache records what its first try decided
(a miss, or which entry it replayed) with a `claim` in the state store (field "cache" of the request's
state, `Address.state_id`), and every later try of it (a redelivery after a crash, a retry) follows that
record, not a new lookup. Without it a miss whose worker died before its commit could meet an entry
stored meanwhile on redelivery and replay it to emit while the first try's generation was still
streaming: emit takes the first chunk of each seq, so the client got a splice of the two answers (or
the reverse: a hit, then a miss once the entry had expired). A request that never reads the cache (not
cacheable by its policy, `no_cache`) always goes on to route and records nothing. The claim is the one
extra Redis round trip, made once the lookup has decided; a state store that is away raises
`InfraUnavailable` (the runner retries the message), while the exact tier away is still a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
import numpy as np

from pipeline import metrics
from pipeline.cache import keys, spelling, synonyms
from pipeline.cache.config import CacheSettings, Policy
from pipeline.cache.exact import ExactTier
from pipeline.cache.index import SemanticIndex, from_vector
from pipeline.cache.traps import Salient, readable, salient
from pipeline.errors import InfraUnavailable, StageError
from pipeline.guard.embedder import MiniLmEmbedder
from pipeline.stage import Address, Out, Stopwatch, address_of
from pipeline.state import MemoryStateStore, StateStore
from pipeline.topology import Topics
from topics.cache import CacheTier, Entry, Purge, TableRecord, Ticket
from topics.errors import ErrorCode
from topics.hops import Admitted
from topics.stream import FinishReason, Usage, digest_of

log = logging.getLogger(__name__)

# The embedder reads the first 256 tokens: two longer questions that differ after them would look the
# same, so they are cached by their exact key only (this bound is the cheap first test; a text of fewer
# characters can still hold more tokens, in Chinese for one, and `reads_whole` counts them).
MAX_SEMANTIC_CHARS = 800
DECISION = "cache"  # the state field a request's first try records its decision in (`_follow`)
MISS = b"miss"  # that decision for a miss; a hit's is b"<tier> <digest of its chunks> <entry key>"
Hit = tuple[CacheTier, Entry]


class CacheStage:
    input_type = Admitted
    ordered = False
    table_type = TableRecord  # llm.cache.entries

    def __init__(
        self, settings: CacheSettings, topics: Topics, exact: ExactTier, embedder: MiniLmEmbedder | None,
        store: StateStore | None = None, name: str = "cache",
    ) -> None:
        self.name, self.topics = name, topics
        self._settings = settings
        self._exact = exact
        self._store = store if store is not None else MemoryStateStore()  # each request's decision (`_follow`)
        self._embedder = embedder  # None: no semantic tier in this process
        self.index = SemanticIndex(settings.max_entries_per_tenant, settings.max_index_bytes)
        if embedder is not None:  # at start rather than in the first lookup; not at all without a semantic tier
            synonyms.load()  # the trap check's WordNet tables (about 0.7 s, 17 MB)
            spelling.load()  # the word list questions are corrected against (about 0.1 s, 11 MB)

    async def aclose(self) -> None:
        await self._exact.aclose()
        await self._store.aclose()

    async def on_table(self, record: Entry | Purge) -> None:
        """Every record of `llm.cache.entries`, from its start (the runner's table loop)."""
        self.index.apply(record)
        metrics.CACHE_ENTRIES.set(len(self.index))

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        clock = Stopwatch()
        request = message.request
        policy = self._settings.policy(message.tenant, request.model)
        if keys.refusal(request, policy) is not None or (request.no_cache and request.no_store):
            metrics.CACHE_LOOKUPS.labels("bypass").inc()
            yield self._miss(message, None, clock)
            return
        key = keys.exact_key(message.tenant, request)
        hit = None
        if request.no_cache:  # it never reads the cache, so it always goes on: no decision to record
            question = await self._question(message, policy)
        else:
            found, question = await self._lookup(message, policy, key)
            hit = await self._follow(message, found)
            if found is not None and found[0] is CacheTier.exact and hit is None and not request.no_store:
                question = await self._question(message, policy)  # a recorded miss: its ticket, as the first try's
        if hit is not None:
            metrics.CACHE_LOOKUPS.labels(f"hit_{hit[0].name}").inc()
            for out in self._replay(message, hit[1], hit[0], clock):
                yield out
            return
        metrics.CACHE_LOOKUPS.labels("bypass" if request.no_cache else "miss").inc()
        ticket = None
        if not request.no_store:
            vector_bytes, marks_bytes = (from_vector(question[0]), msgspec.msgpack.encode(question[1])) if question else (b"", b"")
            ticket = Ticket(key, keys.context(message.tenant, request), policy.ttl_s, vector_bytes, marks_bytes)
        yield self._miss(message, ticket, clock)

    async def _lookup(self, message: Admitted, policy: Policy, key: str) -> tuple[Hit | None, tuple[np.ndarray, Salient] | None]:
        """The exact tier, then the semantic one: the entry found (and its tier), and the question's
        embedding when the semantic tier was asked (None when the exact tier answered, or no semantic tier)."""
        request = message.request
        entry = await self._exact.get(key)
        if entry is not None and _ours(entry, message.tenant, request.model):
            return (CacheTier.exact, entry), None
        question = await self._question(message, policy)
        if question is not None:
            vector, marks = question
            context = keys.context(message.tenant, request)
            found = self.index.search(message.tenant, request.model, context, vector, marks, policy.threshold)
            if found is not None and _ours(found.entry, message.tenant, request.model):
                return (CacheTier.semantic, found.entry), question
        return None, question

    async def _follow(self, message: Admitted, found: Hit | None) -> Hit | None:
        """What the request's first try decided, which this try follows: `found` when this is the first
        try (its decision is claimed now) or it found the same; None for a recorded miss (route takes a
        redelivered request again, the generation's stream is the answer's one stream); a recorded hit's
        entry, looked up again by its key (a semantic hit's is in the exact tier too, where emit stores
        every answer) and served only with the same chunks.

        A recorded hit whose entry is gone (expired, evicted, purged, stored again with other chunks, the
        exact tier away) ends the request with `unavailable` (retriable): its replay may be on emit's
        input already, and emit keeps the first chunk of each seq, so a generation now, or another
        answer, could splice into it. If that replay's `Done` reached emit, emit drops this ending (a
        request's second terminal event); if none of it did, the client hears a retriable 503 where a
        generation would have been safe, which this stage cannot tell apart (a rare cost: the entry must
        go in the moments between a try and its redelivery)."""
        decision = MISS if found is None else f"{found[0].value} {digest_of(found[1].chunks)} {found[1].key}".encode()
        recorded = await self._recorded(address_of(message), decision)
        if recorded == decision:
            return found
        if recorded == MISS:
            return None
        tier, digest, key = recorded.decode().split(" ", 2)
        entry = await self._exact.get(key)
        if entry is not None and digest_of(entry.chunks) == digest and _ours(entry, message.tenant, message.request.model):
            return CacheTier(tier), entry
        raise StageError(ErrorCode.unavailable, "the cached answer this request was being given is gone; send it again")

    async def _recorded(self, address: Address | None, decision: bytes) -> bytes:
        """The decision recorded for the request: `decision` when this call records it (one round trip),
        else the one recorded before (a second). InfraUnavailable when the state store is away."""
        assert address is not None
        if await self._store.claim(address.state_id, DECISION, decision):
            return decision
        recorded = (await self._store.read(address.state_id)).get(DECISION)
        if recorded is None:  # the state expired between the two calls: the next try records afresh
            raise InfraUnavailable("cache: the request's recorded decision expired while it was read")
        return recorded

    async def _question(self, message: Admitted, policy: Policy) -> tuple[np.ndarray, Salient] | None:
        """The last user turn's embedding and salient tokens (None: no semantic tier for this request)."""
        text = keys.last_turn(message.request)
        if self._embedder is None or not policy.semantic or text is None or len(text) > MAX_SEMANTIC_CHARS:
            return None
        if not readable(text) or not self._embedder.reads_whole(text):  # the trap check or the model would be blind
            return None
        text = spelling.corrected(text)  # "invioce" is "invoice" to the vector and the trap check alike
        vector = (await asyncio.to_thread(self._embedder.embed, [text]))[0]
        return vector, salient(text)

    def _miss(self, message: Admitted, ticket: Ticket | None, clock: Stopwatch) -> Out:
        timings = {**message.timings, self.name: clock.ms()}
        return Out(self.topics.forward or "", message.id, msgspec.structs.replace(message, cache=ticket, timings=timings))

    def _replay(self, message: Admitted, entry: Entry, tier: CacheTier, clock: Stopwatch) -> list[Out]:
        address = address_of(message)
        assert address is not None
        stream = self.topics.stream or ""
        outs = [Out(stream, message.id, msgspec.structs.replace(address.chunk(seq, text), cache=tier), with_next=True)
                for seq, text in enumerate(entry.chunks)]
        done = address.done(
            chunks=len(entry.chunks), digest=digest_of(entry.chunks), finish=FinishReason(entry.finish_reason),
            usage=Usage(entry.prompt_tokens, entry.completion_tokens), timings={**message.timings, self.name: clock.ms()},
        )
        outs.append(Out(stream, message.id, msgspec.structs.replace(done, cache=tier, ticket=None)))
        return outs


def _ours(entry: Entry, tenant: str, model: str) -> bool:
    """Whether `entry` is the request's tenant's, for its model: one that is not is never served."""
    if entry.tenant == tenant and entry.model == model:
        return True
    log.warning("cache: an entry of another tenant or model was found for a request and ignored")
    return False

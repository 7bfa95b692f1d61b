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
from pipeline.guard.embedder import MiniLmEmbedder
from pipeline.stage import Out, Stopwatch, address_of
from pipeline.topology import Topics
from topics.cache import CacheTier, Entry, Purge, TableRecord, Ticket
from topics.hops import Admitted
from topics.stream import FinishReason, Usage, digest_of

log = logging.getLogger(__name__)

# The embedder reads the first 256 tokens: two longer questions that differ after them would look the
# same, so they are cached by their exact key only (this bound is the cheap first test; a text of fewer
# characters can still hold more tokens, in Chinese for one, and `reads_whole` counts them).
MAX_SEMANTIC_CHARS = 800


class CacheStage:
    input_type = Admitted
    ordered = False
    table_type = TableRecord  # llm.cache.entries

    def __init__(
        self, settings: CacheSettings, topics: Topics, exact: ExactTier, embedder: MiniLmEmbedder | None,
        name: str = "cache",
    ) -> None:
        self.name, self.topics = name, topics
        self._settings = settings
        self._exact = exact
        self._embedder = embedder  # None: no semantic tier in this process
        self.index = SemanticIndex(settings.max_entries_per_tenant, settings.max_index_bytes)
        if embedder is not None:  # at start rather than in the first lookup; not at all without a semantic tier
            synonyms.load()  # the trap check's WordNet tables (about 0.7 s, 17 MB)
            spelling.load()  # the word list questions are corrected against (about 0.1 s, 11 MB)

    async def aclose(self) -> None:
        await self._exact.aclose()

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
        entry = None if request.no_cache else await self._exact.get(key)
        if entry is not None and _ours(entry, message.tenant, request.model):
            metrics.CACHE_LOOKUPS.labels("hit_exact").inc()
            for out in self._replay(message, entry, CacheTier.exact, clock):
                yield out
            return
        question = await self._question(message, policy)
        if question is not None and not request.no_cache:
            vector, marks = question
            context = keys.context(message.tenant, request)
            found = self.index.search(message.tenant, request.model, context, vector, marks, policy.threshold)
            if found is not None and _ours(found.entry, message.tenant, request.model):
                metrics.CACHE_LOOKUPS.labels("hit_semantic").inc()
                for out in self._replay(message, found.entry, CacheTier.semantic, clock):
                    yield out
                return
        metrics.CACHE_LOOKUPS.labels("bypass" if request.no_cache else "miss").inc()
        ticket = None
        if not request.no_store:
            vector_bytes, marks_bytes = (from_vector(question[0]), msgspec.msgpack.encode(question[1])) if question else (b"", b"")
            ticket = Ticket(key, keys.context(message.tenant, request), policy.ttl_s, vector_bytes, marks_bytes)
        yield self._miss(message, ticket, clock)

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

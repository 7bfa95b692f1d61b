"""The cache stage with emit behind it: what is stored, what is served, to whom, and what never is.

The exact tier is the in-memory one; the semantic tier uses the real MiniLM embedder and usearch."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cache import keys
from pipeline.cache.config import MAX_TTL_S, CacheSettings, TenantCache
from pipeline.cache.exact import MemoryExactTier
from pipeline.cache.index import Found
from pipeline.errors import InfraUnavailable, StageError
from pipeline.guard.embedder import DIMS, load_embedder
from pipeline.settings import Settings
from pipeline.stage import Address, address_of
from pipeline.stages.cache import CacheStage
from pipeline.stages.emit import EmitStage
from pipeline.state import MemoryStateStore
from pipeline.topology import graph
from tests.unit.fakes import run_handler
from tests.unit.helpers import MODEL, SETTINGS, admitted, node, request
from topics import registry
from topics.cache import CacheTier, Entry, Purge, Ticket
from topics.errors import ErrorCode
from topics.hops import Admitted
from topics.requests import ChatMessage, Sampling
from topics.stream import EMPTY_DIGEST, Chunk, Done, FinishReason, Usage, digest_of

pytestmark = pytest.mark.asyncio
CACHE, EMIT, ROUTE = node("cache"), node("emit"), node("route")


@pytest.fixture(scope="module")
def embedder():  # type: ignore[no-untyped-def]
    return load_embedder(SETTINGS.model_cache)


class Pipeline:
    """The cache stage, a stand-in for generation (fixed chunks), and emit, sharing one exact tier."""

    def __init__(self, embedder, cache: CacheSettings | None = None) -> None:  # type: ignore[no-untyped-def]
        config = cache or CacheSettings()
        self.exact = MemoryExactTier()
        self.cache = CacheStage(config, CACHE.topics, self.exact, embedder)
        self.emit = EmitStage(dataclasses.replace(SETTINGS, cache=config), EMIT.topics, answers=self.exact)

    async def ask(self, message: Admitted, answer: tuple[str, ...] = ("Vienna ", "is the capital."), *, fail: bool = False) -> tuple[str, list[object]]:
        """One request end to end: 'hit-exact', 'hit-semantic' or 'miss', and what emit sent the client."""
        outs = await run_handler(self.cache, message)
        if outs[0].topic == CACHE.topics.forward:  # a miss: generate, then emit (which may store it)
            forwarded = outs[0].value
            address = address_of(forwarded)
            assert address is not None
            events: list[object] = [address.chunk(i, t) for i, t in enumerate(answer)]
            if fail:
                events.append(address.failed(ErrorCode.content_filter, "stopped", chunks=len(answer)))
            else:
                events.append(address.done(chunks=len(answer), digest=digest_of(answer), finish=FinishReason.stop, usage=Usage(7, len(answer)), timings={}))
            sent = [o for e in events for o in await run_handler(self.emit, e)]
            for out in sent:
                if out.topic == registry.CACHE_ENTRIES:
                    await self.cache.on_table(out.value)
            return "miss", [o.value for o in sent if o.topic == message.request.reply_to]
        assert all(o.topic == CACHE.topics.stream == registry.CHECKED for o in outs)  # straight to emit
        assert [o.with_next for o in outs] == [True] * (len(outs) - 1) + [False]  # one record batch
        sent = [o for out in outs for o in await run_handler(self.emit, out.value)]
        done = outs[-1].value
        assert isinstance(done, Done) and done.cache is not None
        return done.cache.value, [o.value for o in sent if o.topic == message.request.reply_to]


def chat(text: str, rid: str, tenant: str = "acme", **overrides: object) -> Admitted:
    return admitted(request(rid, messages=(ChatMessage(role="user", content=text),), **overrides), tenant)


async def test_a_repeated_request_is_answered_from_the_exact_tier_with_the_same_chunks(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    first, answer = await p.ask(chat("What is the capital of Austria?", "a1"))
    second, replay = await p.ask(chat("What is the capital of Austria?", "a2"))
    assert (first, second) == ("miss", "hit-exact")
    assert [c.text for c in replay if isinstance(c, Chunk)] == [c.text for c in answer if isinstance(c, Chunk)]
    assert all(c.cache is CacheTier.exact for c in replay if isinstance(c, Chunk))
    done = replay[-1]
    assert isinstance(done, Done) and done.cache is CacheTier.exact and done.ticket is None and done.chunks == 2


async def test_every_parameter_that_changes_the_answer_is_in_the_key(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder, CacheSettings(semantic=False))
    await p.ask(chat("Name a colour.", "b1"))
    for i, change in enumerate([{"sampling": Sampling(max_tokens=9)}, {"sampling": Sampling(max_tokens=8, stop=("\n",))},
                                {"sampling": Sampling(max_tokens=8, top_p=0.5)}, {"model": "another-model"},
                                {"task": "code"}]):  # routing rules may send a task to other backends
        assert (await p.ask(chat("Name a colour.", f"b{i + 2}", **change)))[0] == "miss"
    assert (await p.ask(chat("Name a colour.", "b9")))[0] == "hit-exact"
    assert (await p.ask(chat("Name a colour.", "b10", stream=False, priority="batch")))[0] == "hit-exact"


async def test_sampled_requests_are_cached_only_with_a_seed_or_when_the_tenant_opts_in(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder, CacheSettings(tenants={"loose": TenantCache(sampled=True)}))
    hot = Sampling(max_tokens=8, temperature=0.8)
    await p.ask(chat("Tell me a joke.", "c1", sampling=hot))
    assert (await p.ask(chat("Tell me a joke.", "c2", sampling=hot)))[0] == "miss"
    seeded = Sampling(max_tokens=8, temperature=0.8, seed=3)
    await p.ask(chat("Tell me a joke.", "c3", sampling=seeded))
    assert (await p.ask(chat("Tell me a joke.", "c4", sampling=seeded)))[0] == "hit-exact"
    await p.ask(chat("Tell me a joke.", "c5", tenant="loose", sampling=hot))
    assert (await p.ask(chat("Tell me a joke.", "c6", tenant="loose", sampling=hot)))[0] == "hit-exact"


async def test_no_cache_skips_the_lookup_and_no_store_the_storing(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    await p.ask(chat("Is it raining in Oslo?", "d1", no_store=True))
    assert (await p.ask(chat("Is it raining in Oslo?", "d2")))[0] == "miss"  # nothing was stored
    assert (await p.ask(chat("Is it raining in Oslo?", "d3", no_cache=True)))[0] == "miss"  # stored, not read
    assert (await p.ask(chat("Is it raining in Oslo?", "d4")))[0] == "hit-exact"


async def test_a_filtered_or_failed_answer_is_never_stored(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    status, sent = await p.ask(chat("Write something rude.", "e1"), fail=True)
    assert status == "miss" and sent[-1].code is ErrorCode.content_filter  # type: ignore[attr-defined]
    assert (await p.ask(chat("Write something rude.", "e2")))[0] == "miss"
    assert len(p.cache.index) == 1  # only the second, finished answer


async def test_a_paraphrase_is_a_semantic_hit_and_a_one_word_trap_is_not(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    await p.ask(chat("How do I reset my password?", "f1"))
    assert (await p.ask(chat("How can I reset my password?", "f2")))[0] == "hit-semantic"
    await p.ask(chat("What is the capital of Australia?", "f3"))
    assert (await p.ask(chat("What is the capital of Austria?", "f4")))[0] == "miss"
    await p.ask(chat("Is the office open on Saturday?", "f5"))
    assert (await p.ask(chat("Is the office open on Sunday?", "f6")))[0] == "miss"


async def test_questions_the_trap_check_or_the_model_cannot_read_whole_are_exact_only(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    context = "我上周在你们的网店买了一件外套，收到后发现尺码不合适，颜色也和图片不一样。" * 6  # about 280 characters
    await p.ask(chat(context + "我应该申请退款吗", "z1"))
    assert (await p.ask(chat(context + "我不应该申请退款吗？", "z2")))[0] == "miss"  # negated: MiniLM's cosine 1.0
    assert (await p.ask(chat(context + "我应该申请退款吗", "z3")))[0] == "hit-exact"
    lead = "ok! " * 130  # 520 characters, 260 tokens: the model reads none of what follows
    first, other = lead + "Can I get my money back for the coat?", lead + "How do I change the address of my next order?"
    assert len(other) <= 800 and not embedder.reads_whole(other)
    await p.ask(chat(first, "z4"))
    assert (await p.ask(chat(other, "z5")))[0] == "miss"
    assert len(p.cache.index) == 0


async def test_a_question_with_spelling_slips_is_a_semantic_hit(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    await p.ask(chat("Where can I find my invoice history?", "s1"))
    assert (await p.ask(chat("Where can I find my invioce history?", "s2")))[0] == "hit-semantic"  # 0.64 uncorrected
    await p.ask(chat("How do I aply for a school place for my chlid?", "s3"))  # stored corrected, answered as sent
    assert (await p.ask(chat("How do I apply for a school place for my child?", "s4")))[0] == "hit-semantic"
    assert (await p.ask(chat("How do I appeal a school place for my child?", "s5")))[0] == "miss"


async def test_a_semantic_hit_needs_the_same_earlier_turns(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    netflix = (ChatMessage(role="user", content="I pay for Netflix."), ChatMessage(role="assistant", content="OK."))
    gym = (ChatMessage(role="user", content="I pay for a gym."), ChatMessage(role="assistant", content="OK."))
    await p.ask(admitted(request("g1", messages=(*netflix, ChatMessage(role="user", content="Yes, cancel it."))), "acme"))
    again = admitted(request("g2", messages=(*gym, ChatMessage(role="user", content="Yes, cancel it please."))), "acme")
    assert (await p.ask(again))[0] == "miss"


async def test_a_purge_drops_the_tenants_entries(embedder) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline(embedder)
    await p.ask(chat("How do I reset my password?", "h1"))
    await p.cache.on_table(Purge(tenant="acme", model=None, at=2e9))
    assert (await p.ask(chat("How can I reset my password?", "h2")))[0] == "miss"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    asks=st.lists(st.tuples(
        st.sampled_from(["How do I reset my password?", "How can I reset my password?", "Name a colour.",
                         "What is 2+2?", "what is 2 + 2"]),
        st.sampled_from(["a", "b", "a-b", "A"]),
        st.sampled_from([None, "another-model"]),  # None: the configured model
        st.sampled_from([8, 9]),  # max_tokens, one of the parameters the key holds
    ), min_size=1, max_size=8),
)
async def test_no_entry_of_one_tenant_ever_answers_another(embedder, asks: list[tuple[str, str, str | None, int]]) -> None:  # type: ignore[no-untyped-def]
    """Each answer names the tenant, model, parameters and prompt it was generated for, so a hit shows
    whose entry answered it: one stored for the same tenant, model and parameters (an exact hit: for the
    same prompt too; a semantic hit: any prompt of theirs)."""
    p = Pipeline(embedder)
    offered: dict[tuple[str, str, int], dict[str, str]] = {}  # (tenant, model, max_tokens) -> prompt -> its answer
    for i, (text, tenant, model, max_tokens) in enumerate(asks):
        model = model or MODEL
        answer = (f"[{tenant}|{model}|{max_tokens}] ", f"answer to {text!r}")
        asked = chat(text, f"p{i}", tenant=tenant, model=model, sampling=Sampling(max_tokens=max_tokens))
        status, sent = await p.ask(asked, answer)
        scope = offered.setdefault((tenant, model, max_tokens), {})
        got = "".join(c.text for c in sent if isinstance(c, Chunk))
        if status == "miss":
            assert got == "".join(answer)
            scope.setdefault(text, got)  # the first answer to a prompt is the one its key may keep
        elif status == "hit-exact":
            assert got == scope.get(text), (tenant, model, max_tokens, text, got)  # the same key's own answer
        else:
            assert got in scope.values(), (tenant, model, max_tokens, text, got)  # from the same tenant, model, parameters
    for entry in p.exact._entries.values():
        assert isinstance(entry, Entry) and entry.key.startswith(keys.scope(entry.tenant))


async def test_the_hit_bills_no_tokens_unless_configured(embedder) -> None:  # type: ignore[no-untyped-def]
    charged: list[Usage] = []

    class Meter:
        async def finish(self, event: object) -> None:
            charged.append(event.usage)  # type: ignore[attr-defined]

        async def aclose(self) -> None:
            pass

    p = Pipeline(embedder)
    p.emit._meter = Meter()
    await p.ask(chat("Name a colour.", "i1"))
    await p.ask(chat("Name a colour.", "i2"))
    assert charged[0].completion_tokens == 2 and charged[1] == Usage()
    assert msgspec.json.encode(charged)  # plain structs


async def test_the_default_profile_runs_the_cache_between_guard_and_route() -> None:
    kinds = [n.kind for n in graph(Settings().stages, ("local",))]
    assert kinds.index("guard") < kinds.index("cache") < kinds.index("route")
    assert CACHE.topics.inputs == (registry.SCREENED,) and node("guard").topics.forward == registry.SCREENED
    assert CACHE.topics.forward == ROUTE.topics.inputs[0] and CACHE.topics.table == EMIT.topics.table == registry.CACHE_ENTRIES


async def test_without_a_semantic_tier_an_answer_goes_to_the_exact_tier_only(embedder) -> None:  # type: ignore[no-untyped-def]
    """An entry without an embedding is skipped by every cache worker's index, so emit does not produce
    one: a request whose tenant has no semantic tier costs no message on llm.cache.entries."""
    config = CacheSettings(tenants={"plain": TenantCache(semantic=False)})
    pipeline = Pipeline(embedder, config)
    produced: list[str] = []
    on_table = pipeline.cache.on_table

    async def seen(record: object) -> None:
        produced.append(type(record).__name__)
        await on_table(record)  # type: ignore[arg-type]

    pipeline.cache.on_table = seen  # type: ignore[method-assign]
    assert (await pipeline.ask(chat("What is the capital of Austria?", "r1", tenant="plain")))[0] == "miss"
    assert (await pipeline.ask(chat("What is the capital of Austria?", "r2", tenant="plain")))[0] == "hit-exact"
    assert produced == []
    assert (await pipeline.ask(chat("What is the capital of Austria?", "r3")))[0] == "miss"  # acme: semantic on
    assert produced == ["Entry"]


async def test_an_entry_a_lookup_could_not_read_is_not_indexed(embedder) -> None:  # type: ignore[no-untyped-def]
    from pipeline.cache.index import SemanticIndex
    from pipeline.guard.embedder import DIMS

    p = Pipeline(embedder)
    await p.ask(chat("How do I reset my password?", "g1"))
    [entry] = [e for t in p.cache.index._tenants.values() for e in t.entries.values()]
    index = SemanticIndex()
    for bad in (msgspec.structs.replace(entry, salient=b""), msgspec.structs.replace(entry, finish_reason="x"),
                msgspec.structs.replace(entry, vector=b"\xff\x7f" * DIMS)):  # NaN
        index.apply(bad)  # each made every lookup that reached it fail as `internal`
    assert len(index) == 0
    index.apply(entry)
    assert len(index) == 1


async def test_purge_records_of_different_scopes_never_share_a_compaction_key() -> None:
    from pipeline.cache.purge_cli import purge_key

    assert purge_key("a/b", "c") != purge_key("a", "b/c")  # both were purge/a/b/c: compaction kept one
    assert purge_key("a", None) != purge_key("a", "*") and purge_key("a", "m") == purge_key("a", "m")


OWN = keys.scope("acme", "m") + "0" * 64


@pytest.mark.parametrize(("key", "ttl_s", "stored"), [
    (OWN, 60.0, True),
    ("sluice:gateway:spend:acme", 60.0, False),  # any Redis key at all
    (keys.scope("other", "m") + "0" * 64, 60.0, False),  # another tenant's answer
    (keys.scope("acme", "n") + "0" * 64, 60.0, False),  # another model's
    *[(OWN, ttl_s, False) for ttl_s in (0.0, -5.0, float("inf"), float("nan"), MAX_TTL_S + 1)],
])
async def test_emit_stores_only_in_the_requests_own_scope(key: str, ttl_s: float, stored: bool) -> None:
    """Review found it (session 47): emit wrote to Redis under whatever key the `Done`'s ticket named."""
    exact = MemoryExactTier()
    emit = EmitStage(SETTINGS, EMIT.topics, answers=exact)
    ticket = Ticket(key, "c", ttl_s, bytes(2 * DIMS))
    address = Address("acme/e1", "llm.responses.sdk", "acme", "m", time.time(), 300.0, ticket)
    done = address.done(chunks=0, digest=EMPTY_DIGEST, finish=FinishReason.stop, usage=Usage(), timings={})
    outs = await run_handler(emit, done)
    assert bool(exact._entries) is stored and any(o.topic == registry.CACHE_ENTRIES for o in outs) is stored


def foreign(key: str, tenant: str, model: str) -> Entry:
    now = time.time()
    return Entry(key=key, tenant=tenant, model=model, context="c", chunks=("Red.",), finish_reason="stop",
                 prompt_tokens=1, completion_tokens=1, stored_at=now, expires_at=now + 60.0)


async def test_an_exact_entry_of_another_tenant_or_model_is_never_served() -> None:
    """The key makes it impossible; the check is the second lock (what emit stores comes off a topic)."""
    message = chat("Name a colour.", "x1")
    key = keys.exact_key("acme", message.request)
    own = message.request.model
    for tenant, model, served in (("evil", own, False), ("acme", "other", False), ("acme", own, True)):
        exact = MemoryExactTier()
        await exact.put(foreign(key, tenant, model))
        outs = await run_handler(CacheStage(CacheSettings(), CACHE.topics, exact, None), message)
        assert (outs[0].topic != CACHE.topics.forward) is served


async def test_a_semantic_entry_of_another_tenant_or_model_is_never_served(embedder) -> None:  # type: ignore[no-untyped-def]
    message = chat("Name a colour.", "x2")
    model = message.request.model
    for tenant, entry_model, served in (("evil", model, False), ("acme", "other", False), ("acme", model, True)):
        stage = CacheStage(CacheSettings(), CACHE.topics, MemoryExactTier(), embedder)
        entry = foreign(keys.scope(tenant, entry_model) + "k", tenant, entry_model)
        stage.index.search = lambda *_, found=Found(entry, 1.0): found  # type: ignore[method-assign]
        outs = await run_handler(stage, message)
        assert (outs[0].topic != CACHE.topics.forward) is served


def answer(key: str, chunks: tuple[str, ...], tenant: str = "acme") -> Entry:
    """An answer emit stored under `key` (another request's, with the same key or a paraphrase)."""
    now = time.time()
    return Entry(key=key, tenant=tenant, model=request("x").model, context="c", chunks=chunks, finish_reason="stop",
                 prompt_tokens=1, completion_tokens=len(chunks), stored_at=now, expires_at=now + 60.0)


def workers(exact: MemoryExactTier, embedder: object = None) -> tuple[CacheStage, CacheStage]:
    """Two cache workers sharing the exact tier and the state store: A's try, then B's redelivery."""
    store = MemoryStateStore()
    return (CacheStage(CacheSettings(), CACHE.topics, exact, embedder, store),  # type: ignore[arg-type]
            CacheStage(CacheSettings(), CACHE.topics, exact, None, store))


async def test_a_redelivered_miss_is_not_answered_from_an_entry_stored_meanwhile() -> None:
    """Review found it (session 47): worker A missed and forwarded, then died before its commit; an answer
    for the same key was stored meanwhile; worker B replayed it on the redelivery while A's generation
    streamed, and emit, which keeps the first chunk of each seq, gave the client a splice of the two."""
    exact = MemoryExactTier()
    a, b = workers(exact)
    message = chat("What is the capital of Austria?", "v1")
    [forwarded] = await run_handler(a, message)
    assert forwarded.topic == CACHE.topics.forward
    await exact.put(answer(keys.exact_key("acme", message.request), ("Vienna ", " the capital.")))
    redelivered = await run_handler(b, message)
    address = address_of(forwarded.value)
    assert address is not None
    generated = ("Vienna ", "is the capital.")
    events = [address.chunk(0, generated[0]), *(o.value for o in redelivered if o.topic == CACHE.topics.stream),
              address.chunk(1, generated[1]),
              address.done(chunks=2, digest=digest_of(generated), finish=FinishReason.stop, usage=Usage(7, 2), timings={})]
    emit = EmitStage(SETTINGS, EMIT.topics)
    sent = [o.value for e in events for o in await run_handler(emit, e) if o.topic == message.request.reply_to]
    assert [c.text for c in sent if isinstance(c, Chunk)] == list(generated) and isinstance(sent[-1], Done)
    assert [o.topic for o in redelivered] == [CACHE.topics.forward] and redelivered[0].value.cache == forwarded.value.cache


async def test_a_redelivered_hit_replays_the_same_answer_or_none() -> None:
    """The reverse: a hit whose entry is gone (expired, evicted, stored again with another answer) on its
    redelivery was generated, and the generation could splice into the replay. It ends `unavailable`."""
    exact = MemoryExactTier()
    a, b = workers(exact)
    message = chat("What is the capital of Austria?", "v2")
    key = keys.exact_key("acme", message.request)
    await exact.put(answer(key, ("Vienna ", "is the capital.")))
    first = await run_handler(a, message)
    again = await run_handler(b, message)
    assert [(o.topic, getattr(o.value, "text", None)) for o in again] == [(o.topic, getattr(o.value, "text", None)) for o in first]
    assert first[-1].topic == CACHE.topics.stream and first[-1].value.cache is CacheTier.exact  # type: ignore[attr-defined]
    for gone in (answer(key, ("Vienna.",)), None):  # stored again with another answer, then purged
        await exact.purge(keys.scope("acme"))
        if gone is not None:
            await exact.put(gone)
        with pytest.raises(StageError) as ended:
            await run_handler(b, message)
        assert ended.value.code is ErrorCode.unavailable and ended.value.retriable


async def test_a_redelivered_semantic_hit_is_replayed_by_a_worker_whose_index_lacks_it(embedder) -> None:  # type: ignore[no-untyped-def]
    exact = MemoryExactTier()
    a, b = workers(exact, embedder)
    message = chat("How can I reset my password?", "v3")
    entry = answer(keys.scope("acme", message.request.model) + "paraphrase", ("Open ", "settings."))
    await exact.put(entry)  # emit stores every answer in the exact tier, under its own request's key
    a.index.search = lambda *_: Found(entry, 1.0)  # type: ignore[method-assign]
    first = await run_handler(a, message)
    again = await run_handler(b, message)  # no embedder, an empty index: its own lookup misses
    assert [o.topic for o in again] == [CACHE.topics.stream] * 3
    assert [o.value for o in again[:-1]] == [o.value for o in first[:-1]] and again[-1].value.cache is CacheTier.semantic  # type: ignore[attr-defined]


async def test_the_state_store_away_is_waited_for_and_a_no_cache_request_records_nothing() -> None:
    class Away(MemoryStateStore):
        async def claim(self, key: str, field: str, value: bytes) -> bool:
            raise InfraUnavailable("redis state store: ConnectionError")

    stage = CacheStage(CacheSettings(), CACHE.topics, MemoryExactTier(), None, Away())
    with pytest.raises(InfraUnavailable):  # the runner's backoff, as for every stage that claims
        await run_handler(stage, chat("Name a colour.", "v4"))
    [out] = await run_handler(stage, chat("Name a colour.", "v5", no_cache=True))  # it never reads the cache
    assert out.topic == CACHE.topics.forward and out.value.cache is not None  # type: ignore[attr-defined]

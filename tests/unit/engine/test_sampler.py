"""Sampler: greedy, seeded draws reproducible per position, top-k, top-p, repetition penalty."""

from __future__ import annotations

import torch

from pipeline.engine.params import SamplingParams
from pipeline.engine.sampler import apply_penalty, sample_token, token_probs


def test_seeded_draws_depend_only_on_seed_and_position() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [sample_token(logits, params, position) for position in range(20)]
    assert draws == [sample_token(logits, params, position) for position in range(20)]
    assert len(set(draws)) > 1


def test_greedy_top_k_and_top_p() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0])
    assert sample_token(logits, SamplingParams(), 0) == 1
    probs = token_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[[0, 3]] == 0).all() and probs[1] > probs[2] > 0
    nucleus = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert int((nucleus > 0).sum()) == 1
    assert all(sample_token(logits, SamplingParams(temperature=1.0, top_k=1, seed=s), 3) == 1 for s in range(10))


def test_repetition_penalty_follows_the_transformers_rule() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_penalty(logits, SamplingParams(repetition_penalty=2.0), [0, 1, 1])
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_a_tiny_temperature_draws_the_likeliest_token_not_nan() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -5.0])
    params = SamplingParams(temperature=1e-40, seed=3)
    probs = token_probs(logits, params)
    assert not torch.isnan(probs).any() and probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample_token(logits, params, position=0) == 1  # it raised in torch.multinomial, failing the whole step


def test_a_temperature_or_top_p_that_is_not_a_number_is_refused() -> None:
    import pytest

    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}):
        with pytest.raises(ValueError):  # NaN passed `< 0.0` and failed every row of its step in multinomial
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_top_p_renormalises_the_nucleus() -> None:
    """Rejection sampling compares p(draft) with q(draft): a nucleus summing to its mass (0.85 here) kept
    drafts with probability 0.85 * p(draft)."""
    logits = torch.log(torch.tensor([0.45, 0.40, 0.10, 0.05]))
    probs = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.45, 0.40, 0.0, 0.0]) / 0.85)
    both = token_probs(logits, SamplingParams(temperature=0.7, top_k=3, top_p=0.9))
    assert abs(float(both.sum()) - 1.0) < 1e-6

"""Verification of a chunk with n-gram drafts (verify.py): under temperature it emits exactly the tokens
plain decoding draws at the same completion indices, so drafting changes how many forwards a sequence
takes, never which tokens it gets."""

from __future__ import annotations

import torch

from pipeline.engine.params import EngineRequest, SamplingParams
from pipeline.engine.sampler import sample_token
from pipeline.engine.scheduler import ScheduledChunk
from pipeline.engine.sequence import Sequence
from pipeline.engine.verify import verify

VOCAB = 50
PROMPT = (1, 2, 3, 4, 5)
COMPLETION = (6, 7)  # the pending token (7) has no KV yet: it is token_ids[0] of the chunk


def chunk_with(params: SamplingParams, drafts: list[int]) -> ScheduledChunk:
    seq = Sequence.from_request(EngineRequest(PROMPT, max_tokens=32, sampling=params, completion_ids=COMPLETION), 0, 0)
    start = len(seq.token_ids) - 1
    return ScheduledChunk(seq, start, (seq.token_ids[-1], *drafts), (), True, len(COMPLETION), len(drafts))


def plain_draws(params: SamplingParams, logits: torch.Tensor) -> list[int]:
    """What plain decoding draws, one token a step, given the rows' logits."""
    drawn: list[int] = []
    for i in range(len(logits)):
        history = [*PROMPT, *COMPLETION, *drawn]
        drawn.append(sample_token(logits[i], params, len(COMPLETION) + i, history))
    return drawn


def test_verify_under_temperature_emits_plain_decodings_tokens() -> None:
    """For 100 seeds: drafts that are plain's draws are all kept and the bonus is plain's next draw; a
    wrong draft at row j ends the step with plain's draw there. Rejection sampling with its own uniform
    draws kept a right draft only with probability p(draft) and replaced it with another sample."""
    gen = torch.Generator().manual_seed(0)
    for seed in range(100):
        params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=seed)
        logits = torch.randn(5, VOCAB, generator=gen) * 2
        plain = plain_draws(params, logits)
        assert verify(chunk_with(params, plain[:4]), logits) == tuple(plain)
        j = seed % 4
        wrong = [*plain[:j], (plain[j] + 1) % VOCAB, *plain[j + 1 : 4]]
        assert verify(chunk_with(params, wrong), logits) == tuple(plain[: j + 1])


def test_verify_under_greedy_keeps_the_argmax_run() -> None:
    logits = torch.nn.functional.one_hot(torch.tensor([9, 8, 7]), VOCAB).float() * 5
    assert verify(chunk_with(SamplingParams(), [9, 8]), logits) == (9, 8, 7)
    assert verify(chunk_with(SamplingParams(), [9, 3]), logits) == (9, 8)

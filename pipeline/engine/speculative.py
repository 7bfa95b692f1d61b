"""Speculative decoding at batch 1: cheap guesses, verified in one forward of the target.

One step (Leviathan et al. 2023; prompt lookup decoding for the n-gram proposer):

    1. a proposer drafts up to k tokens after prompt + output: an n-gram lookup in the text so far
       (`NGramProposer`, no model), or a small model that shares the target's tokenizer
       (`DraftModelProposer`, with its own KV cache);
    2. the target runs ONE forward over [pending token, d1..dk] and returns k+1 rows of logits;
    3. acceptance keeps the longest run of drafts the target agrees with and adds one token of the
       target's own, so a step emits 1..k+1 tokens. Greedy (`accept_greedy`): a draft is kept while it
       equals the target's argmax, so the output is exactly the target's greedy output. Sampling
       with a draft model (`accept_rejection_sampling`): keep with probability min(1, p/q), else draw
       from norm(max(0, p - q)), so the output is distributed as the target's samples. Sampling with
       n-gram drafts (`accept_coupled`): draw each position's token as plain decoding would and keep
       the drafts while they equal the draws, so the output is plain decoding's own tokens;
    4. the target's KV is truncated to the tokens kept; the target's own token is the next pending one.

`AdaptiveDraftLength` moves k with the running acceptance rate. `SpeculativeDecoder` runs the loop
against the `TargetModel` protocol; `HuggingFaceModel` implements it over a transformers causal LM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from pipeline.engine.drafting import AdaptiveDraftLength, NGramProposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipeline.engine.llm_engine import LLMEngine

__all__ = [
    "AdaptiveDraftLength",
    "DraftModelProposer",
    "DraftProposer",
    "EngineModel",
    "Generation",
    "HuggingFaceModel",
    "NGramProposer",
    "Proposer",
    "SpeculativeDecoder",
    "SpeculativeStats",
    "TargetModel",
    "accept_coupled",
    "accept_greedy",
    "accept_rejection_sampling",
    "to_probs",
]


class TargetModel(Protocol):
    """A causal LM holding the KV cache of one sequence (also what a draft model is wrapped in)."""

    def forward_tokens(self, token_ids: list[int]) -> Tensor:
        """Append `token_ids` to the KV cache; float logits [len(token_ids), vocab], one row per new position."""
        ...

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions of the KV cache and drop the rest (0 empties it)."""
        ...


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (prompt + output so far); [] when it has no guess."""
        ...


@runtime_checkable
class DraftProposer(Proposer, Protocol):
    def propose_with_probs(
        self, token_ids: Sequence[int], k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], Tensor]:
        """k tokens drawn from the draft at `temperature` and the distributions q they came from, [k, vocab]."""
        ...


def to_probs(logits: Tensor, temperature: float) -> Tensor:
    """Softmax at `temperature` over the last dimension; temperature 0 is greedy: one-hot at the argmax."""
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    return torch.softmax(logits.float() / temperature, dim=-1)


def _draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class DraftModelProposer:
    """Drafts with a small causal LM that shares the target's tokenizer, through its own KV cache.

    The cache holds a prefix of the sequence. Each call rolls it back to the longest prefix that is
    still true (the target may have rejected drafts) and feeds only what is new, so a step costs the
    draft about k single-token forwards.
    """

    def __init__(self, model: TargetModel) -> None:
        self.model = model
        self._cached: list[int] = []  # the tokens whose KV the draft model holds, in order

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.propose_with_probs(token_ids, k, 0.0, None)[0]

    def propose_with_probs(
        self, token_ids: Sequence[int], k: int, temperature: float = 0.0, generator: torch.Generator | None = None
    ) -> tuple[list[int], Tensor]:
        if k <= 0:
            return [], torch.empty(0)
        logits = self._catch_up(list(token_ids))
        tokens: list[int] = []
        rows: list[Tensor] = []
        for i in range(k):
            probs = to_probs(logits, temperature)
            tokens.append(int(probs.argmax()) if temperature <= 0 else _draw(probs, generator))
            rows.append(probs)
            if i + 1 < k:  # the last draft is fed next time, if the target keeps it
                logits = self._feed([tokens[-1]])
        return tokens, torch.stack(rows)

    def _catch_up(self, ids: list[int]) -> Tensor:
        """Roll the cache back to the common prefix, feed the rest; logits for the token after `ids`."""
        keep = 0
        for cached, wanted in zip(self._cached, ids):
            if cached != wanted:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # feed at least one token: its logits give the first draft
        self.model.truncate(keep)
        del self._cached[keep:]
        return self._feed(ids[keep:])

    def _feed(self, ids: list[int]) -> Tensor:
        logits = self.model.forward_tokens(ids)
        self._cached.extend(ids)
        return logits[-1]


def accept_greedy(draft_tokens: Sequence[int], target_logits: Tensor) -> list[int]:
    """The drafts that equal the target's argmax, up to the first that does not, then the target's own token.

    `target_logits` has one row per draft plus one ([k+1, vocab]): row i scores the token after draft i-1.
    Returns 1..k+1 tokens: exactly what greedy decoding with the target alone would produce.
    """
    choices = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == choices[n]:
        n += 1
    return [*draft_tokens[:n], choices[n]]


def accept_coupled(draft_tokens: Sequence[int], draw: Callable[[int], int]) -> list[int]:
    """Acceptance for deterministic drafts (n-gram, or a greedy draft): `draw(i)` is the token plain
    decoding would draw at row i (the drafts before it taken as the text so far). Draft i is kept while
    it equals draw(i); the first draw that differs is emitted and ends the step; when every draft is
    kept, draw(k) is the bonus token. Rows are drawn only as far as they are needed.

    For a proposal q one-hot at the draft this is the min(1, p/q) rule: a draft is kept with
    probability p(draft), and a draw that differs is distributed as p without the draft, the residual
    norm(max(0, p - q)); so it keeps as many drafts as rejection sampling. Unlike it, the emitted tokens
    are exactly plain decoding's for the same draws, whether a step drafted or not and however many.
    """
    out: list[int] = []
    for i, token in enumerate(draft_tokens):
        out.append(draw(i))
        if out[-1] != token:
            return out
    out.append(draw(len(draft_tokens)))
    return out


def accept_rejection_sampling(
    draft_tokens: Sequence[int],
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Leviathan et al. 2023, algorithm 1: the kept drafts, then one token drawn from the target's side.

    Draft i is kept with probability min(1, p(x)/q(x)); at the first rejection a token is drawn from
    norm(max(0, p - q)) and the step ends; when every draft is kept, a bonus token is drawn from row k
    of `target_probs` ([k+1, vocab]; each row normalised, as `to_probs` and `sampler.token_probs` give).
    Each emitted token is distributed exactly as a sample from the target. `draft_probs` ([k, vocab])
    is None for a deterministic proposer (n-gram, or a greedy draft): q is then one-hot at the draft and
    the rule is `accept_coupled`, one draw from `generator` per emitted token as plain decoding makes.
    """
    if draft_probs is None:
        return accept_coupled(draft_tokens, lambda i: _draw(target_probs[i], generator))
    out: list[int] = []
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] < p[token]:  # u < p/q, without dividing by q
            out.append(token)
            continue
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection has (almost) no mass to go to
            residual = p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[len(draft_tokens)], generator))
    return out


@dataclass
class SpeculativeStats:
    steps: int = 0  # target forwards after the prefill (each emits 1..k+1 tokens)
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, the ones the target kept
    prefill_s: float = 0.0  # the prompt's forward and the first token (wall clock)
    decode_s: float = 0.0  # every later token (wall clock)
    decode_cpu_s: float = 0.0  # the same in this process's CPU time: steadier than wall time on a shared machine

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, ending with a stop token when one was produced
    stats: SpeculativeStats


class SpeculativeDecoder:
    """The speculative loop for one sequence at a time. Without a proposer it is plain decoding.

    With a deterministic proposer (n-gram) the tokens are plain decoding's, at temperature too: each
    emitted token is one draw from `generator`, as without drafts. With a draft model at temperature
    they are distributed as plain decoding's but are not the same draws (the draft draws from
    `generator` too, and a kept draft is the draft's sample); a fixed generator seed still repeats them.

    `draft_length` keeps its running rate between `generate` calls: use one decoder per request (or per
    workload) when that should not carry over.
    """

    def __init__(
        self,
        target: TargetModel,
        proposer: Proposer | None,
        *,
        draft_length: int | AdaptiveDraftLength = 4,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.draft_length = (
            draft_length if isinstance(draft_length, AdaptiveDraftLength) else AdaptiveDraftLength(*[draft_length] * 3)
        )
        self.temperature = temperature
        self.generator = generator

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Generation:
        stats = SpeculativeStats()
        started, started_cpu = time.perf_counter(), time.process_time()
        self.target.truncate(0)
        first = self._accept([], None, self.target.forward_tokens(list(prompt_ids))[-1:])
        output = first[:max_new_tokens]
        stats.prefill_s, prefill_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
        new = list(output)  # the tokens the last step emitted
        while len(output) < max_new_tokens and not any(token in stop_token_ids for token in new):
            context = [*prompt_ids, *output]  # the target's KV holds all but the last (pending) token
            drafts, draft_probs = self._propose(context, min(self.draft_length.k, max_new_tokens - len(output) - 1))
            new = self._accept(drafts, draft_probs, self.target.forward_tokens([output[-1], *drafts]))
            self.target.truncate(len(context) + len(new) - 1)  # keep the pending token and the kept drafts
            self.draft_length.observe(len(drafts), len(new) - 1)
            stats.steps += 1
            stats.proposed += len(drafts)
            stats.accepted += len(new) - 1
            output.extend(new)
        stats.decode_s = time.perf_counter() - started - stats.prefill_s
        stats.decode_cpu_s = time.process_time() - started_cpu - prefill_cpu_s
        return Generation(_cut(output, max_new_tokens, stop_token_ids), stats)

    def _propose(self, context: list[int], k: int) -> tuple[list[int], Tensor | None]:
        if self.proposer is None or k <= 0:
            return [], None
        if self.temperature > 0 and isinstance(self.proposer, DraftProposer):
            return self.proposer.propose_with_probs(context, k, self.temperature, self.generator)
        return self.proposer.propose(context, k)[:k], None

    def _accept(self, drafts: list[int], draft_probs: Tensor | None, logits: Tensor) -> list[int]:
        if self.temperature <= 0:
            return accept_greedy(drafts, logits)
        return accept_rejection_sampling(drafts, draft_probs, to_probs(logits, self.temperature), self.generator)


def _cut(tokens: list[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
    """At most max_new_tokens, ending at (and keeping) the first stop token."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_token_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


class HuggingFaceModel:
    """`TargetModel` over a transformers causal LM at batch 1: its KV in a `DynamicCache`, rolled back by crop."""

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers import DynamicCache

        self.model = model
        self._new_cache = DynamicCache
        self.cache = DynamicCache()

    def forward_tokens(self, token_ids: list[int]) -> Tensor:
        input_ids = torch.tensor([token_ids], device=self.model.device)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        return out.logits[0].float()

    def truncate(self, num_tokens: int) -> None:
        if num_tokens == 0:
            self.cache = self._new_cache()
        else:
            self.cache.crop(num_tokens)


class EngineModel:
    """`TargetModel` over the project's engine (`LLMEngine`): one sequence driven alone, outside the
    scheduler's queues, its KV in the engine's paged blocks (never registered in the prefix cache).

    `LLMEngine.truncate(seq, n)` rolls back the last n tokens and may drop a few more (a partial block
    shared with another sequence); those are fed again, in front of the next call's tokens.
    """

    def __init__(self, engine: LLMEngine) -> None:
        from pipeline.engine.params import EngineRequest

        self.engine = engine
        self.seq = engine.scheduler.new_sequence(EngineRequest(prompt_ids=(), max_tokens=1))
        self._kept: list[int] = []  # the tokens whose KV this sequence should hold

    def forward_tokens(self, token_ids: list[int]) -> Tensor:
        missing = self._kept[self.seq.num_computed_tokens :]
        logits = self.engine.forward_tokens(self.seq, [*missing, *token_ids])
        self._kept.extend(token_ids)
        return logits[len(missing) :]

    def truncate(self, num_tokens: int) -> None:
        del self._kept[num_tokens:]
        extra = self.seq.num_computed_tokens - num_tokens
        if extra > 0:
            self.engine.truncate(self.seq, extra)

    def close(self) -> None:
        """Give the sequence's blocks back to the engine."""
        self.engine.block_manager.deallocate(self.seq)
        self._kept.clear()

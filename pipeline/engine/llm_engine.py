"""The engine loop: `step()` = schedule, run, postprocess, collect; plus KV export/import and the
hooks speculative decoding drives (`forward_tokens`, `truncate`, `append_tokens`).

Synchronous and single-threaded by itself; `AsyncEngine` (async_engine.py) runs the model part of
each step in a thread for asyncio callers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.errors import KVMismatch, RequestTooLarge
from pipeline.engine.kv_transfer import KVState
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.params import EngineRequest
from pipeline.engine.scheduler import Scheduler, SchedulerOutput
from pipeline.engine.sequence import Sequence, SequenceStatus

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.config = runner.config
        self.block_manager = BlockManager(runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.block_manager, runner.model_config.max_position_embeddings)
        self.interrupted_steps = 0  # steps stopped by their interrupt (AsyncEngine: batch-only steps an arrival stopped)

    @classmethod
    def from_path(cls, path: Path, config: EngineConfig | None = None) -> LLMEngine:
        return cls(ModelRunner.from_path(path, config or EngineConfig()))

    def add_request(self, request: EngineRequest, *, park_after_first: bool = False) -> Sequence:
        return self.scheduler.add(request, park_after_first=park_after_first)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that got new tokens (their last `num_new_tokens` ids)."""
        output = self.scheduler.schedule()
        sampled = self.execute(output)
        return self.scheduler.update_from_output(output, sampled)

    def execute(self, output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        """The model part of a step (thread-safe against scheduler calls made while it runs); `interrupt`
        as `ModelRunner.run` takes it."""
        return self.runner.run(output, interrupt)

    def abort(self, seq: Sequence) -> bool:
        return self.scheduler.abort(seq)

    def generate(self, requests: list[EngineRequest]) -> list[list[int]]:
        """Run `requests` to completion together; each one's new completion tokens, in order."""
        seqs = [self.add_request(r) for r in requests]
        while self.has_unfinished():
            self.step()
        return [s.completion_ids[len(r.completion_ids) :] for s, r in zip(seqs, requests, strict=True)]

    # -- prefill/decode handoff -------------------------------------------------------------------

    @property
    def model_fingerprint(self) -> str:
        """The model a KV state must come from to be imported here: its shape, dtype and a digest of its
        weights (`LlamaWeights.digest`), so a checkpoint of the same shape with other weights (a
        fine-tune, a re-conversion during a rolling update) never hands its K/V to this one."""
        c = self.runner.model_config
        shape = f"{c.num_layers}x{c.num_kv_heads}x{c.head_dim}/{c.vocab_size}/{c.rope_theta}/{self.config.dtype}"
        return f"{shape}/{self.runner.weights_digest[:16]}"

    def export_kv(self, seq: Sequence, *, staged: bool = False) -> KVState:
        """The state of a parked (or otherwise idle) sequence; it stays where it is. `staged`: its K/V
        are views of the runner's staging buffer, valid until the next staged export (`ModelRunner.read_kv`)."""
        k, v = self.runner.read_kv(seq.block_table, seq.num_computed_tokens, staged=staged)
        return KVState(request=seq.to_request(), model=self.model_fingerprint, k=k, v=v)

    def import_kv(self, state: KVState, request: EngineRequest | None = None) -> Sequence:
        """A parked sequence holding `state`'s KV in fresh blocks; resume it with `scheduler.unpark`.

        With `request`, the sequence is `request` (its sampling, limits and stop tokens), and the state
        only supplies K/V: its prompt and salt must be the request's and its completion a prefix of the
        request's (a decode that resumes after a crash has more tokens than prefill had; the next step
        computes those). Otherwise `KVMismatch`, and the caller recomputes."""
        request = self.check_import(state, request)
        seq = self.reserve_import(state, request)
        self.runner.write_kv(seq.block_table, state.k, state.v)
        self.finish_import(seq)
        return seq

    def check_import(self, state: KVState, request: EngineRequest | None) -> EngineRequest:
        """The request the imported sequence will be; `KVMismatch` when the state does not fit it."""
        if state.model != self.model_fingerprint:
            raise KVMismatch(f"KV state of model {state.model}, this engine runs {self.model_fingerprint}")
        if request is None:
            return state.request
        if (state.request.prompt_ids, state.request.salt) != (request.prompt_ids, request.salt) or (
            request.completion_ids[: len(state.request.completion_ids)] != state.request.completion_ids
        ):
            raise KVMismatch("the KV state belongs to other tokens than this request's")
        return request

    def reserve_import(self, state: KVState, request: EngineRequest) -> Sequence:
        """`import_kv`'s bookkeeping half (on the scheduler's thread): a sequence with blocks for the
        state's K/V, in no queue yet; write the K/V into them, then `finish_import`."""
        seq = self.scheduler.new_sequence(request)
        c = self.runner.model_config
        computed = int(state.k.shape[1]) if state.k.dim() == 4 else -1
        shape = (c.num_layers, computed, c.num_kv_heads, c.head_dim)  # what `read_kv` exports
        if tuple(state.k.shape) != shape or tuple(state.v.shape) != shape or {state.k.dtype, state.v.dtype} != {self.runner.kv_dtype}:
            # another shape of as many numbers would be written through a view of the pool, into other
            # sequences' blocks
            raise KVMismatch(f"K/V of shape {tuple(state.k.shape)} {state.k.dtype}, expected {shape} {self.runner.kv_dtype}")
        if computed != len(state.request.prompt_ids) + len(state.request.completion_ids) - 1:
            raise KVMismatch(f"{computed} tokens of KV for {len(seq.token_ids)} tokens (expected one fewer)")
        total = len(request.prompt_ids) + max(request.max_tokens, len(request.completion_ids))
        if total > self.scheduler.max_model_len or self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            # as `Scheduler.add` refuses it: it would preempt itself and wait for good (the backend recomputes)
            raise RequestTooLarge(f"{total} tokens exceed the context ({self.scheduler.max_model_len}) or the KV pool")
        if not self.block_manager.can_allocate(seq, computed, use_cache=False):
            raise RequestTooLarge(f"no room for {computed} imported tokens")
        self.block_manager.allocate(seq, computed, use_cache=False)
        seq.num_computed_tokens = computed
        return seq

    def finish_import(self, seq: Sequence) -> None:
        """Register the written blocks in the prefix cache and park the sequence."""
        self.block_manager.commit(seq)
        self.scheduler.adopt_parked(seq)

    # -- speculative decoding hooks ---------------------------------------------------------------

    def forward_tokens(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Target forward over `token_ids` right after the computed tokens, in one call: allocates
        their blocks, writes their KV, advances `num_computed_tokens`, returns logits [n, vocab].

        A verify step for a sequence whose last token `t` has no KV yet, with drafts d1..dk:
            logits = engine.forward_tokens(seq, [t, *drafts])   # row i scores the token after fed[i]
            ... accept m drafts and a bonus/correction token c ...
            engine.truncate(seq, k - m)                      # drop the KV of the rejected drafts
            engine.append_tokens(seq, [*drafts[:m], c])      # the sequence's tokens; finishes if it should
        Call it outside `step()` for a sequence that is not RUNNING (parked, or driven alone)."""
        if not self.block_manager.can_allocate(seq, len(token_ids), use_cache=False):
            raise RequestTooLarge(f"no free blocks for {len(token_ids)} tokens")
        self.block_manager.allocate(seq, len(token_ids), use_cache=False)
        return self.runner.forward_tokens(seq, token_ids)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back the KV of the last `num_tokens` computed tokens (token ids are the caller's)."""
        self.block_manager.truncate(seq, num_tokens)

    def append_tokens(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        """Append tokens as if sampled, stopping at a stop token or max_tokens (which finishes the
        sequence and frees its blocks); returns the tokens actually appended."""
        taken: list[int] = []
        for token in token_ids:
            seq.token_ids.append(token)
            taken.append(token)
            if seq.reached_stop():
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
                self.block_manager.commit(seq)
                self.scheduler.abort(seq)
                seq.status = SequenceStatus.FINISHED
                break
        else:
            self.block_manager.commit(seq)
        return taken


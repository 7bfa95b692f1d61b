"""Run the model over a scheduler step: one batched forward for every scheduled token, paged KV.

The KV pool is two tensors per engine, [layers, blocks, block_size, kv_heads, head_dim]. Each step
writes the new tokens' K and V into their slots (block_table[pos // block_size], pos % block_size),
then attends:

- decode chunks (one token each) and other short chunks over earlier KV (speculative decoding's
  verification chunks of k + 1 tokens), on a CPU: one call per layer of the compiled kernel
  (`paged_kernel.py`) that reads each query row's keys and values in place from its sequence's blocks;
  a chunk's tokens are rows of their own, token j attending to positions up to start + j (causal);
- decode chunks elsewhere (or where the kernel cannot be built): in groups of similar length, sorted
  by length and cut into groups of up to DECODE_GROUP, each group's blocks gathered into one padded
  [group, kv_heads, max_len, head_dim] tensor and one scaled_dot_product_attention call run with a
  mask hiding each sequence's padding (sorting keeps the padding, and so the bytes gathered, small
  when lengths differ widely);
- other chunks are attended one by one: a first chunk attends to its own fresh K/V causally, a later
  one (or one after a prefix-cache hit) gathers its earlier blocks with a causal offset mask.

The projections, MLPs and lm_head run once over all the step's tokens, in the weights' dtype; on a CPU
their weights are packed once into oneDNN's layout (`packed_linear.py`, `EngineConfig.packed_weights`). The same
code runs on CUDA with device tensors; one choice differs by device: on a CPU the KV pool and attention
stay float32 whatever the weights' dtype (`kv_dtype`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.engine.config import EngineConfig, ModelConfig
from pipeline.engine.errors import StepInterrupted
from pipeline.engine.llama import LlamaWeights, apply_rotary, mlp, rms_norm, rotary
from pipeline.engine.packed_linear import linear, pack
from pipeline.engine.paged_kernel import paged_decode
from pipeline.engine.params import MAX_DRAFT_TOKENS
from pipeline.engine.sampler import sample_batch
from pipeline.engine.scheduler import ScheduledChunk, SchedulerOutput, StepTokens
from pipeline.engine.sequence import Sequence
from pipeline.engine.verify import verify

__all__ = ["ModelRunner"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_GROUP = 8
KERNEL_CHUNK = MAX_DRAFT_TOKENS + 1  # chunks over earlier KV up to this long (a verification's) use the kernel


@dataclass(frozen=True)
class _Prefill:
    row: int  # first row of this chunk in the step's flattened tokens
    n: int
    start: int
    blocks: torch.Tensor | None  # the sequence's blocks when it attends to earlier KV
    mask: torch.Tensor | None  # [n, start + n] causal-with-offset mask


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # [G] rows of these decodes in the step's tokens
    length: int  # the longest member's length (keys beyond it are not gathered)
    blocks: torch.Tensor  # [G, max_blocks], padded with block 0
    mask: torch.Tensor | None  # [G, 1, 1, length]; None when every member has the same length


@dataclass(frozen=True)
class _PagedRows:
    rows: torch.Tensor  # [R] rows of the step's tokens that the kernel attends
    tables: torch.Tensor  # [R, max_blocks] int64, each row's sequence's blocks, padded with block 0 (never read past a length)
    lengths: torch.Tensor  # [R] int64, positions each row attends to, its own included


@dataclass(frozen=True)
class _Plan:
    ids: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat slot of each token in the pool
    cos: torch.Tensor
    sin: torch.Tensor
    decodes: tuple[_DecodeGroup, ...]  # single-token decodes, without the kernel
    paged: _PagedRows | None  # decodes and short chunks, with the kernel (then `decodes` is empty)
    prefills: tuple[_Prefill, ...]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: LlamaWeights, config: EngineConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        cpu = self.device.type == "cpu"
        # which weights the KV pool's K/V come from (`LLMEngine.model_fingerprint`): of the plain tensors, once
        self.weights_digest = weights.digest()
        self.weights = pack(weights) if cpu and config.packed_weights else weights  # reordered once for oneDNN
        self.dtype = _DTYPES[config.dtype]
        # The KV pool's dtype, in which attention computes: the model's, except on a CPU, where PyTorch's
        # attention kernel is several times slower in bfloat16 than in float32 (1.3 against 0.26 ms a call
        # for 12 decodes over 300 tokens here) and converting the gathered K/V each step costs as much again:
        # there the pool stays float32 (lower-precision weights still halve the bytes of every projection)
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.block_size = config.block_size
        per_block = model_config.kv_bytes_per_token(self.kv_dtype.itemsize) * config.block_size
        self.num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // per_block)
        shape = (model_config.num_layers, self.num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        # torch.empty: pages are touched (and count as resident) only once a block is used. A block is
        # zeroed the first time a step uses it (`_first_use`): attention reads whole blocks, masking the
        # slots past a sequence's length, and uninitialised memory there may hold NaN, which a zero
        # attention weight does not cancel (0 * NaN = NaN): it once turned a greedy token into 0.
        self.k_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self._zeroed = 0  # blocks 0 .. _zeroed - 1 have been zeroed (the block manager hands out fresh ones in order)
        self._staging: torch.Tensor | None = None  # `read_kv(staged=True)`'s buffer
        self._paged_decode = paged_decode() if config.decode_kernel and cpu else None  # a float32 pool there

    @classmethod
    def from_path(cls, path: Path, config: EngineConfig) -> ModelRunner:
        model_config = ModelConfig.from_path(path)
        weights = LlamaWeights.load(path, model_config, config.device, _DTYPES[config.dtype])
        return cls(model_config, weights, config)

    @classmethod
    def from_transformers(cls, model: torch.nn.Module, config: EngineConfig) -> ModelRunner:
        """Share the weights of a loaded transformers Llama-family model (no copy on the same device)."""
        model_config = ModelConfig.from_dict(model.config.to_dict())  # type: ignore[operator]
        weights = LlamaWeights.from_state_dict(dict(model.state_dict()), model_config, config.device, _DTYPES[config.dtype])
        return cls(model_config, weights, config)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_bytes_per_token(self.kv_dtype.itemsize)

    def run(self, output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[StepTokens]:
        """Compute the step and sample; returns one entry per chunk (`StepTokens`: None where it did not
        sample, the accepted tokens where it verified drafts). Blocking: the async engine calls it in its
        model thread. `interrupt`: checked before each layer within the config's `interrupt_batch_steps`
        share of them (1: every layer, 0.5: the first half); once set, the step stops there and raises
        `StepInterrupted` (the K/V it wrote lie past every sequence's computed tokens: the next step that
        feeds those tokens writes them again). Past that share a step finishes: with 0.5 a step is never
        stopped when what it has done outweighs the wait it would save (docs/benchmarks.md)."""
        chunks = list(output.chunks)
        if not chunks:
            return []
        rows: list[int] = []
        row = 0
        for chunk in chunks:
            row += len(chunk.token_ids)
            if chunk.num_drafts:  # every position: row i scores the token after token_ids[i]
                rows.extend(range(row - len(chunk.token_ids), row))
            elif chunk.sample:
                rows.append(row - 1)
        results: list[StepTokens] = [None] * len(chunks)
        with torch.inference_mode():
            logits = self._forward(chunks, torch.tensor(rows, dtype=torch.long, device=self.device), interrupt).float()
            per_chunk = logits.split([len(c.token_ids) if c.num_drafts else int(c.sample) for c in chunks])
            plain = [i for i, c in enumerate(chunks) if c.sample and not c.num_drafts]
            if plain:
                drawn = sample_batch(
                    torch.cat([per_chunk[i] for i in plain]),
                    [chunks[i].seq.sampling for i in plain],
                    [chunks[i].seq.token_ids for i in plain],
                    [chunks[i].completion_index for i in plain],
                )
                for i, token in zip(plain, drawn, strict=True):
                    results[i] = token
            for i, chunk in enumerate(chunks):
                if chunk.num_drafts:
                    results[i] = verify(chunk, per_chunk[i])
        return results

    def forward_tokens(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Feed `token_ids` at positions `seq.num_computed_tokens ...`, write their KV, advance
        `seq.num_computed_tokens` by their count, and return float32 logits [len(token_ids), vocab]
        (row i predicts the token after token_ids[i]). Blocks must already cover the new positions
        (`BlockManager.allocate(seq, len(token_ids))`); `seq.token_ids` is left to the caller."""
        start = seq.num_computed_tokens
        chunk = ScheduledChunk(seq, start, tuple(token_ids), tuple(seq.block_table), True, 0)
        with torch.inference_mode():
            rows = torch.arange(len(token_ids), device=self.device)
            logits = self._forward([chunk], rows).float()
        seq.num_computed_tokens = start + len(token_ids)
        return logits

    def read_kv(self, block_table: list[int], num_tokens: int, *, staged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `num_tokens` positions, [layers, num_tokens, kv_heads, head_dim], on CPU.

        `staged`: gathered into the runner's staging buffer (kept, grown to the largest read so far, at
        most the pool's size), which the next staged read overwrites; a handoff gathers there so that it
        does not fault in 2 x 22 MiB of fresh pages per 1,000 tokens (docs/benchmarks.md)."""
        slots = self._slots(block_table, 0, num_tokens).to(self.device)
        # index_select copies rows of kv_heads x head_dim; `cache[:, slots]` went element by element (5x slower)
        flat_k = self.k_cache.view(self.k_cache.shape[0], -1, *self.k_cache.shape[3:])
        flat_v = self.v_cache.view(flat_k.shape)
        shape = (flat_k.shape[0], num_tokens, *flat_k.shape[2:])
        if not staged or self.device.type != "cpu":
            return flat_k.index_select(1, slots).cpu(), flat_v.index_select(1, slots).cpu()
        count = flat_k[:, :num_tokens].numel()
        if self._staging is None or self._staging.numel() < 2 * count:
            self._staging = None  # free the old one before taking the larger
            self._staging = torch.empty(2 * count, dtype=self.kv_dtype)
        k, v = self._staging[:count].view(shape), self._staging[count : 2 * count].view(shape)
        torch.index_select(flat_k, 1, slots, out=k)
        torch.index_select(flat_v, 1, slots, out=v)
        return k, v

    def write_kv(self, block_table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Put K and V (as `read_kv` returns them) into positions 0.. of the given blocks."""
        self._first_use(block_table)
        slots = self._slots(block_table, 0, k.shape[1]).to(self.device)
        flat = self.k_cache.shape[1] * self.block_size
        self.k_cache.view(k.shape[0], flat, *k.shape[2:]).index_copy_(1, slots, k.to(self.device, self.kv_dtype))
        self.v_cache.view(v.shape[0], flat, *v.shape[2:]).index_copy_(1, slots, v.to(self.device, self.kv_dtype))

    def _forward(
        self, chunks: list[ScheduledChunk], rows: torch.Tensor, interrupt: threading.Event | None = None,
    ) -> torch.Tensor:
        plan = self._plan(chunks)
        cfg, w = self.model_config, self.weights
        x = F.embedding(plan.ids, w.embed)
        tokens = x.shape[0]
        stoppable = math.ceil(len(w.layers) * self.config.interrupt_batch_steps)  # an interrupt acts before these layers only
        for index, layer in enumerate(w.layers):
            if interrupt is not None and index < stoppable and interrupt.is_set():
                raise StepInterrupted(f"step stopped before layer {index} of {len(w.layers)}")
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            q = linear(h, layer.q, layer.q_bias).view(tokens, cfg.num_heads, cfg.head_dim)
            k = linear(h, layer.k, layer.k_bias).view(tokens, cfg.num_kv_heads, cfg.head_dim)
            v = linear(h, layer.v, layer.v_bias).view(tokens, cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rotary(q, plan.cos, plan.sin), apply_rotary(k, plan.cos, plan.sin)
            k_pool, v_pool = self.k_cache[index], self.v_cache[index]
            k_pool.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, plan.slots, k.to(self.kv_dtype))
            v_pool.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, plan.slots, v.to(self.kv_dtype))
            attn = self._attention(q, k, v, k_pool, v_pool, plan)
            x = x + linear(attn.reshape(tokens, -1), layer.o)
            x = x + mlp(rms_norm(x, layer.post_norm, cfg.rms_norm_eps), layer)
        x = rms_norm(x.index_select(0, rows), w.norm, cfg.rms_norm_eps)
        return linear(x, w.lm_head)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        scale = self.model_config.head_dim**-0.5
        out = torch.empty_like(q)  # [T, heads, head_dim]
        if plan.paged is not None and self._paged_decode is not None:
            p = plan.paged
            query = q.index_select(0, p.rows).to(self.kv_dtype)
            out.index_copy_(0, p.rows, self._paged_decode(query, k_pool, v_pool, p.tables, p.lengths, scale).to(q.dtype))
        for g in plan.decodes:
            keys = _gather(k_pool, g.blocks)[:, : g.length].transpose(1, 2)  # [G, kv_heads, L, head_dim]
            values = _gather(v_pool, g.blocks)[:, : g.length].transpose(1, 2)
            query = q.index_select(0, g.rows).unsqueeze(2)
            o = self._sdpa(query, keys, values, attn_mask=g.mask, scale=scale)
            out.index_copy_(0, g.rows, o.squeeze(2))
        for p in plan.prefills:
            query = q[p.row : p.row + p.n].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:  # a first chunk: its own K/V, plain causal attention
                keys = k[p.row : p.row + p.n].transpose(0, 1).unsqueeze(0)
                values = v[p.row : p.row + p.n].transpose(0, 1).unsqueeze(0)
                o = self._sdpa(query, keys, values, is_causal=True, scale=scale)
            else:
                length = p.start + p.n
                keys = _gather(k_pool, p.blocks[None])[:, :length].transpose(1, 2)
                values = _gather(v_pool, p.blocks[None])[:, :length].transpose(1, 2)
                o = self._sdpa(query, keys, values, attn_mask=p.mask, scale=scale)
            out[p.row : p.row + p.n] = o[0].transpose(0, 1)
        return out

    def _sdpa(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **options: object) -> torch.Tensor:
        """scaled_dot_product_attention in the pool's dtype; the result in the model's."""
        t = self.kv_dtype
        o = F.scaled_dot_product_attention(query.to(t), keys.to(t), values.to(t), enable_gqa=True, **options)  # type: ignore[arg-type]
        return o.to(query.dtype)

    def _first_use(self, block_ids: Iterable[int]) -> None:
        """Zero every block up to the highest id in `block_ids` that no step has used yet (block 0, the
        padding of batched decodes, is always among them)."""
        top = max(block_ids, default=-1) + 1
        if top > self._zeroed:
            self.k_cache[:, self._zeroed : top].zero_()
            self.v_cache[:, self._zeroed : top].zero_()
            self._zeroed = top

    def _plan(self, chunks: list[ScheduledChunk]) -> _Plan:
        self._first_use(max(c.block_table, default=0) for c in chunks)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        for chunk in chunks:
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
            slots.append(self._slots(list(chunk.block_table), chunk.start, len(chunk.token_ids)))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = rotary(pos.to(dev), self.model_config.head_dim, self.model_config.rope_theta, self.dtype)
        num_decode = 0
        while num_decode < len(chunks) and len(chunks[num_decode].token_ids) == 1 and chunks[num_decode].start > 0:
            num_decode += 1
        kernel = self._paged_decode is not None
        paged: list[tuple[int, ScheduledChunk]] = []  # (first row, chunk) attended by the kernel
        prefills, row = [], 0
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            if kernel and chunk.start > 0 and n <= KERNEL_CHUNK:
                paged.append((row, chunk))
            elif i >= num_decode or kernel:
                prefills.append(self._prefill_plan(chunk, row))
            row += n
        decodes = self._decode_groups(chunks[:num_decode]) if not kernel else ()
        return _Plan(
            ids=torch.tensor(ids, dtype=torch.long).to(dev),
            slots=torch.cat(slots).to(dev),
            cos=cos,
            sin=sin,
            decodes=decodes,
            paged=self._paged_plan(paged) if paged else None,
            prefills=tuple(prefills),
        )

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> tuple[_DecodeGroup, ...]:
        order = sorted(range(len(decodes)), key=lambda i: decodes[i].start)
        groups = []
        for first in range(0, len(order), DECODE_GROUP):
            members = order[first : first + DECODE_GROUP]
            lengths = [decodes[i].start + 1 for i in members]
            length = max(lengths)
            table = torch.zeros(len(members), -(-length // self.block_size), dtype=torch.long)
            for row, i in enumerate(members):
                used = decodes[i].block_table[: -(-lengths[row] // self.block_size)]
                table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
            mask = None
            if len(set(lengths)) > 1:
                mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :].to(self.device)
            rows = torch.tensor(members, dtype=torch.long, device=self.device)
            groups.append(_DecodeGroup(rows, length, table.to(self.device), mask))
        return tuple(groups)

    def _paged_plan(self, chunks: list[tuple[int, ScheduledChunk]]) -> _PagedRows:
        """One kernel row per token of each chunk: token j of a chunk at `start` attends to start + j + 1
        positions of its sequence's blocks (its own K/V written before attention)."""
        rows: list[int] = []
        lengths: list[int] = []
        tables: list[tuple[int, ...]] = []
        for first, chunk in chunks:
            n = len(chunk.token_ids)
            used = chunk.block_table[: -(-(chunk.start + n) // self.block_size)]
            rows.extend(range(first, first + n))
            lengths.extend(range(chunk.start + 1, chunk.start + n + 1))
            tables.extend([used] * n)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + (0,) * (width - len(t)) for t in tables], dtype=torch.long)
        dev = self.device
        return _PagedRows(torch.tensor(rows, dtype=torch.long, device=dev), table, torch.tensor(lengths, dtype=torch.long))

    def _prefill_plan(self, chunk: ScheduledChunk, row: int) -> _Prefill:
        n, start = len(chunk.token_ids), chunk.start
        if start == 0:
            return _Prefill(row, n, 0, None, None)
        length = start + n
        blocks = torch.tensor(chunk.block_table[: -(-length // self.block_size)], dtype=torch.long).to(self.device)
        mask = (torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]).to(self.device)
        return _Prefill(row, n, start, blocks, mask)

    def _slots(self, block_table: list[int], start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


def _gather(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks [B, W] of one layer's pool [num_blocks, block_size, kv_heads, head_dim] as
    [B, W * block_size, kv_heads, head_dim]. index_select copies whole blocks as rows, several times
    faster on CPU than advanced indexing, which goes element by element."""
    rows = pool.view(pool.shape[0], -1).index_select(0, blocks.flatten())
    return rows.view(blocks.shape[0], blocks.shape[1] * pool.shape[1], *pool.shape[2:])

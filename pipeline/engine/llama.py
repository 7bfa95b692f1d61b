"""The Llama-family decoder as plain tensors: weights, RMSNorm, rotary embeddings, GQA projections,
SwiGLU MLP, tied or separate lm_head. Attention itself (over the paged KV pool) is the runner's.

The arithmetic follows transformers' Llama implementation step by step (float32 RMSNorm, rotate-half
rotary embedding with the config's rope_theta), so greedy output matches `generate` token for token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pipeline.engine.config import ModelConfig
from pipeline.engine.packed_linear import linear

__all__ = ["LayerWeights", "LlamaWeights", "rms_norm", "rotary", "apply_rotary"]

DIGEST_SAMPLE = 4096  # values of each tensor that `LlamaWeights.digest` reads


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    @classmethod
    def load(cls, path: Path, config: ModelConfig, device: str, dtype: torch.dtype) -> LlamaWeights:
        """Read every `*.safetensors` file in `path` (the layout transformers saves)."""
        raw: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            raw.update(load_file(str(file), device="cpu"))
        if not raw:
            raise FileNotFoundError(f"no .safetensors weights in {path}")
        return cls.from_state_dict(raw, config, device, dtype)

    @classmethod
    def from_state_dict(
        cls, raw: dict[str, torch.Tensor], config: ModelConfig, device: str, dtype: torch.dtype
    ) -> LlamaWeights:
        def get(name: str) -> torch.Tensor:
            return raw[name].to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in raw else None

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    input_norm=get(p + "input_layernorm.weight"),
                    q=get(p + "self_attn.q_proj.weight"),
                    k=get(p + "self_attn.k_proj.weight"),
                    v=get(p + "self_attn.v_proj.weight"),
                    o=get(p + "self_attn.o_proj.weight"),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate=get(p + "mlp.gate_proj.weight"),
                    up=get(p + "mlp.up_proj.weight"),
                    down=get(p + "mlp.down_proj.weight"),
                    q_bias=maybe(p + "self_attn.q_proj.bias"),
                    k_bias=maybe(p + "self_attn.k_proj.bias"),
                    v_bias=maybe(p + "self_attn.v_proj.bias"),
                )
            )
        embed = get("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings or "lm_head.weight" not in raw else get("lm_head.weight")
        return cls(embed=embed, layers=tuple(layers), norm=get("model.norm.weight"), lm_head=head)

    @classmethod
    def random(cls, config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaWeights:
        """Random weights of the given shape (for throughput checks where real weights cannot travel)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, kv, inter = config.hidden_size, config.num_kv_heads * config.head_dim, config.intermediate_size

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dtype)

        def ones() -> torch.Tensor:
            return torch.ones(h, device=device, dtype=dtype)

        qd = config.num_heads * config.head_dim
        layers = tuple(
            LayerWeights(ones(), w(qd, h), w(kv, h), w(kv, h), w(h, qd), ones(), w(inter, h), w(inter, h), w(h, inter))
            for _ in range(config.num_layers)
        )
        embed = w(config.vocab_size, h)
        return cls(embed=embed, layers=layers, norm=ones(), lm_head=embed)

    def digest(self) -> str:
        """sha256 (hex) over every tensor's role, shape, dtype and DIGEST_SAMPLE of its values, evenly
        strided through it (an odd stride, so a matrix is not read down one column). Two loads of one
        checkpoint in one dtype agree, whether read from disk or shared by a transformers model; other
        weights of the same shape (a fine-tune, a re-conversion of a changed source) differ unless every
        sampled value is equal. Taken of plain tensors, before `pack`: 11-45 ms for SmolLM2-135M on a
        busy 2-core CPU (1-2% of its `ModelRunner.from_path`), against 560 ms to hash every byte and
        170 ms to sum every value as an integer."""
        h = hashlib.sha256()
        named = [("embed", self.embed), ("norm", self.norm), ("lm_head", self.lm_head)]
        for i, layer in enumerate(self.layers):
            named += [(f"{i}.{f.name}", getattr(layer, f.name)) for f in fields(layer) if getattr(layer, f.name) is not None]
        for name, tensor in named:
            flat = tensor.reshape(-1)
            sample = flat[:: flat.numel() // DIGEST_SAMPLE | 1][:DIGEST_SAMPLE]
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            h.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, head_dim] for the given positions (the default, unscaled rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    return linear(F.silu(linear(x, layer.gate)) * linear(x, layer.up), layer.down)

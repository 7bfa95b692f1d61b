"""Frozen configs: the model's shape (read from a checkpoint's config.json) and the engine's limits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EngineConfig", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family shape the model runner builds (SmolLM2, Qwen2.5 without biases, Llama)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> ModelConfig:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])  # type: ignore[call-overload]
        if raw.get("rope_scaling"):
            raise ValueError(f"rope_scaling {raw['rope_scaling']!r} is not supported by this runner")
        return cls(
            vocab_size=int(raw["vocab_size"]),  # type: ignore[call-overload]
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),  # type: ignore[call-overload]
            num_layers=int(raw["num_hidden_layers"]),  # type: ignore[call-overload]
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),  # type: ignore[call-overload]
            head_dim=int(raw.get("head_dim") or hidden // heads),  # type: ignore[call-overload]
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=float(raw.get("rope_theta", 10000.0)),  # type: ignore[arg-type]
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),  # type: ignore[call-overload]
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
        )

    @classmethod
    def from_path(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads((path / "config.json").read_text()))

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine; every field is validated in `__post_init__` (never by `assert`)."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV pool size in blocks; 0 means "as many as kv_cache_bytes allows"
    kv_cache_bytes: int = 512 * 2**20  # pool budget when num_blocks is 0
    max_num_seqs: int = 32  # sequences running in one step
    max_num_batched_tokens: int = 512  # tokens fed to the model in one step (prefill chunks plus decodes)
    max_parked: int = 64  # prefilled sequences waiting for their decode; the oldest is dropped beyond this
    aging_steps: int = 32  # on the batch lane's steps, a batch request waiting this many steps goes ahead of interactive ones
    batch_every: int = 8  # while interactive sequences run, the batch lane is fed on every n-th step only (1: always)
    handoff_hold_ms: float = 50.0  # after an interactive prefill, the batch lane waits up to this for its decode (0: never)
    # woken from idle, the engine waits up to this long for a burst of arrivals to pause (3 ms
    # without one) before its first step, so requests handed over one by one (Triton's, ~1 ms apart) start
    # in one step instead of the first alone and the rest behind it (0: step at once; with it a lone request
    # waits 3 ms, a burst up to this)
    gather_arrivals_ms: float = 0.0
    batch_prompt_tokens: int = 64  # batch-lane prompt tokens per step, bounding the step an interactive request waits behind (0: no cap)
    shared_prompt_tokens: int = 16  # the same cap in a step shared with interactive rows (0: batch_prompt_tokens applies)
    # an interactive arrival stops a batch-only step within this share of its layers (1: anywhere, 0.5: in its
    # first half, 0: never); on this CPU 1 kept interactive p99 lowest and 0.5 the batch lane's progress highest
    interrupt_batch_steps: float = 1.0
    # on a CPU, attend decodes and short chunks over earlier KV (speculative verification) with the compiled
    # kernel that reads the paged pool in place (`paged_kernel.py`;
    # the torch path serves where it cannot be built, and on other devices)
    decode_kernel: bool = True
    # on a CPU, reorder the projection weights once into oneDNN's layout (`packed_linear.py`): 1.26x a
    # one-row forward, 1.7x a nine-row one on this CPU; false keeps F.linear (MKL sgemm, packing per call)
    packed_weights: bool = True
    device: str = "cpu"
    dtype: str = "float32"  # float32, bfloat16 or float16

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_parked": self.max_parked,
            "aging_steps": self.aging_steps,
            "batch_every": self.batch_every,
        }
        bad = {k: v for k, v in positive.items() if v < 1}
        if bad:
            raise ValueError(f"engine limits must be at least 1: {bad}")
        if self.batch_prompt_tokens < 0 or self.shared_prompt_tokens < 0:
            raise ValueError(f"batch_prompt_tokens and shared_prompt_tokens must not be negative, got "
                             f"{self.batch_prompt_tokens} and {self.shared_prompt_tokens}")
        if not 0 <= self.interrupt_batch_steps <= 1:
            raise ValueError(f"interrupt_batch_steps is a share of a step's layers, 0 to 1, got {self.interrupt_batch_steps}")
        if self.handoff_hold_ms < 0:
            raise ValueError(f"handoff_hold_ms must not be negative, got {self.handoff_hold_ms}")
        if self.gather_arrivals_ms < 0:
            raise ValueError(f"gather_arrivals_ms must not be negative, got {self.gather_arrivals_ms}")
        if self.num_blocks < 0 or (self.num_blocks == 0 and self.kv_cache_bytes < 1):
            raise ValueError("num_blocks must be positive, or 0 with a positive kv_cache_bytes")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

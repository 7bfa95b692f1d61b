"""A sequence's state as bytes, so a decode worker in another process continues it: its tokens, its
request fields, and the K/V of every computed token. Encoded as safetensors (tensors plus a JSON
header; no pickle), checked against the importing engine's model shape and block-independent."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load

from pipeline.engine.errors import KVMismatch
from pipeline.engine.params import EngineRequest, Priority, SamplingParams, SpeculativeParams

__all__ = ["KVState"]

_VERSION = "1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class KVState:
    request: EngineRequest  # prompt and completion so far (the last completion token has no KV yet)
    model: str  # a fingerprint of the model shape and dtype the K/V belong to
    k: torch.Tensor  # [layers, computed tokens, kv_heads, head_dim]
    v: torch.Tensor

    def to_bytes(self) -> bytes:
        r = self.request
        header = {
            "version": _VERSION,
            "model": self.model,
            "prompt_ids": json.dumps(list(r.prompt_ids)),
            "completion_ids": json.dumps(list(r.completion_ids)),
            "max_tokens": str(r.max_tokens),
            "sampling": json.dumps(asdict(r.sampling)),
            "stop_token_ids": json.dumps(sorted(r.stop_token_ids)),
            "priority": str(int(r.priority)),
            "salt": r.salt,
            "speculative": json.dumps(asdict(r.speculative) if r.speculative else None),
        }
        return _safetensors_bytes({"k": self.k, "v": self.v}, header)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVState:
        try:
            tensors = load(data)
            header = _header(data)
            request = EngineRequest(
                prompt_ids=tuple(json.loads(header["prompt_ids"])),
                completion_ids=tuple(json.loads(header["completion_ids"])),
                max_tokens=int(header["max_tokens"]),
                sampling=SamplingParams(**json.loads(header["sampling"])),
                stop_token_ids=frozenset(json.loads(header["stop_token_ids"])),
                priority=Priority(int(header["priority"])),
                salt=header["salt"],
                speculative=_speculative(header.get("speculative")),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise KVMismatch(f"not a KV state this engine can read: {exc}") from exc
        if header.get("version") != _VERSION:
            raise KVMismatch(f"KV state version {header.get('version')!r}, expected {_VERSION}")
        return cls(request=request, model=header["model"], k=tensors["k"], v=tensors["v"])


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors encoding of `tensors` (what `safetensors.torch.save` writes, and `load` reads),
    built with one copy of each tensor's bytes: `save` took 240 ms for the 44 MiB of a 1,000-token
    SmolLM2 state against about 20 ms here, and that was most of what a handoff cost (docs/benchmarks.md)."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        shape = list(tensor.shape)
        entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    parts = [len(header).to_bytes(8, "little"), header]
    parts += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()]
    return b"".join(parts)


def _speculative(raw: str | None) -> SpeculativeParams | None:
    fields = json.loads(raw) if raw else None  # absent: written before speculation was per request
    return SpeculativeParams(**fields) if fields else None


def _header(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + size]).get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return {str(k): str(v) for k, v in meta.items()}

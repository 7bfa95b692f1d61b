"""A sequence's state as bytes, so a decode worker in another process continues it: its tokens, its
request fields, and the K/V of every computed token. Encoded as safetensors (tensors plus a JSON
header; no pickle), checked against the importing engine's model (shape, dtype and a digest of its
weights) and block-independent.

Neither direction copies the K/V on its own: `to_buffers` hands out the header and the tensors' memory
(a writer puts them in a file with one `writev`), and `from_buffer` reads the tensors in place from
the buffer it is given (a mapped file), so the only copies left are the engine's gather out of its
pool and its write into the importing pool. Fresh memory is what a copy costs most here: a 1,000-token
SmolLM2 state is 44 MiB, and faulting in 44 MiB of new pages took 80-260 ms against 3-15 ms for a
copy into memory already in use (docs/benchmarks.md)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from pipeline.engine.errors import KVMismatch
from pipeline.engine.kv_store import Buffer
from pipeline.engine.params import EngineRequest, Priority, SamplingParams, SpeculativeParams

__all__ = ["Buffer", "KVState"]

_VERSION = "1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 1 << 24  # a header this large is not one we wrote (prompt ids of the longest context are far less)


@dataclass(frozen=True)
class KVState:
    request: EngineRequest  # prompt and completion so far (the last completion token has no KV yet)
    model: str  # a fingerprint of the model (shape, dtype, weights digest) the K/V belong to
    k: torch.Tensor  # [layers, computed tokens, kv_heads, head_dim]
    v: torch.Tensor

    def to_buffers(self) -> list[Buffer]:
        """The safetensors encoding as parts to write one after another: the length and header, then
        each tensor's memory as it lies (no copy for contiguous tensors, so they must not change until
        the parts are written)."""
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
        return _safetensors_parts({"k": self.k, "v": self.v}, header)

    def to_bytes(self) -> bytes:
        return b"".join(self.to_buffers())

    @classmethod
    def from_buffer(cls, data: Buffer) -> KVState:
        """The state in `data` (bytes, or a mapped file); its tensors are views of `data` when it is
        writable, which they keep alive, else of a copy. `KVMismatch` when it is not a state we wrote."""
        try:
            header, tensors = _parse(data)
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
            model, k, v = header["model"], tensors["k"], tensors["v"]
        except (KeyError, ValueError, TypeError) as exc:
            raise KVMismatch(f"not a KV state this engine can read: {exc}") from exc
        if header.get("version") != _VERSION:
            raise KVMismatch(f"KV state version {header.get('version')!r}, expected {_VERSION}")
        return cls(request=request, model=model, k=k, v=v)


def _safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Buffer]:
    """The safetensors encoding of `tensors` (what `safetensors.torch.save` writes, and `load` reads)
    as parts: `save` took 240 ms for the 44 MiB of a 1,000-token SmolLM2 state, and joining the
    tensors' bytes into one string two more fresh copies (docs/benchmarks.md)."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        shape = list(tensor.shape)
        entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    parts: list[Buffer] = [len(header).to_bytes(8, "little") + header]
    parts += [_memory(t) for t in tensors.values()]
    return parts


def _memory(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in place (a copy only when it is not contiguous), as one flat buffer."""
    flat = tensor.contiguous().view(-1).view(torch.uint8)  # uint8 first: numpy has no bfloat16
    return memoryview(flat.numpy())


def _parse(data: Buffer) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and the tensors of a safetensors buffer, every offset and shape checked against
    the buffer's size (a file can be cut short or be something else)."""
    view = memoryview(data).cast("B")
    if view.readonly:  # torch tensors are writable; a read-only buffer (bytes) is copied once
        view = memoryview(bytearray(view))
    if len(view) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(view[:8], "little")
    if size > min(_MAX_HEADER, len(view) - 8):
        raise ValueError(f"header of {size} bytes in {len(view)}")
    entries = json.loads(bytes(view[8 : 8 + size]))
    meta = entries.pop("__metadata__", None) if isinstance(entries, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    start, tensors = 8 + size, {}
    for name, entry in entries.items():
        dtype = _BY_NAME[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
        count = 1
        for n in shape:
            count *= n
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(view) - start:
            raise ValueError(f"tensor {name!r} lies outside the buffer")
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape}")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(view, dtype=dtype, count=count, offset=start + begin).view(shape)
    return {str(k): str(v) for k, v in meta.items()}, tensors


def _speculative(raw: str | None) -> SpeculativeParams | None:
    fields = json.loads(raw) if raw else None  # absent: written before speculation was per request
    return SpeculativeParams(**fields) if fields else None

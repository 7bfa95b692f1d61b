"""KVState's encoding: safetensors that the library itself reads back, for every pool dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from pipeline.engine.kv_transfer import KVState
from pipeline.engine.params import EngineRequest, SamplingParams, SpeculativeParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_bytes_are_safetensors_and_round_trip(dtype: torch.dtype) -> None:
    request = EngineRequest(
        (5, 6, 7), completion_ids=(8,), max_tokens=9, sampling=SamplingParams.of(0.7, 0.9, 3),
        stop_token_ids=frozenset({2}), salt="tenant", speculative=SpeculativeParams(num_draft_tokens=5),
    )
    k = torch.randn(2, 3, 3, 4).to(dtype)
    v = torch.randn(2, 3, 3, 4).to(dtype)[:, :, :, :3]  # not contiguous: encoded as its values
    state = KVState(request=request, model="fingerprint", k=k, v=v)
    data = state.to_bytes()
    tensors = load(data)  # the safetensors library parses it
    assert torch.equal(tensors["k"], k) and torch.equal(tensors["v"], v)
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0  # the data starts 8-byte aligned
    back = KVState.from_buffer(data)
    assert back.request == request and back.model == "fingerprint"
    assert back.k.dtype == dtype and torch.equal(back.k, k) and torch.equal(back.v, v)


def _state(dtype: torch.dtype = torch.float32) -> KVState:
    request = EngineRequest((5, 6, 7), completion_ids=(8,), max_tokens=9, sampling=SamplingParams(temperature=0.0))
    return KVState(request=request, model="m", k=torch.randn(2, 3, 3, 4).to(dtype), v=torch.randn(2, 3, 3, 4).to(dtype))


def test_the_parts_are_the_tensors_memory_and_a_writable_buffer_is_read_in_place() -> None:
    """No copy either way: what a handoff writes is the K/V's own memory, and what it imports from a
    mapped file are views of the mapping."""
    state = _state()
    parts = state.to_buffers()
    assert len(parts) == 3 and b"".join(parts) == state.to_bytes()
    assert torch.frombuffer(parts[1], dtype=torch.float32).data_ptr() == state.k.data_ptr()
    buffer = bytearray(state.to_bytes())
    back = KVState.from_buffer(memoryview(buffer))
    assert torch.equal(back.k, state.k) and torch.equal(back.v, state.v)
    start = memoryview(buffer).tobytes().index(state.k.numpy().tobytes())
    buffer[start] ^= 0xFF  # the imported tensor sees a change of the buffer: it is a view, not a copy
    assert not torch.equal(back.k, state.k)


def _with_header(data: bytes, edit: object) -> bytes:
    import json

    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    edit(header)  # type: ignore[operator]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + size :]


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d[:5],  # shorter than the length prefix
        lambda d: (2**40).to_bytes(8, "little") + d[8:],  # a header longer than the buffer
        lambda d: d[:-4],  # the last tensor cut short
        lambda d: _with_header(d, lambda h: h["k"].update(data_offsets=[0, 10**9])),  # offsets outside
        lambda d: _with_header(d, lambda h: h["k"].update(shape=[2, 3, 3, 5])),  # shape and size disagree
        lambda d: _with_header(d, lambda h: h["v"].update(dtype="I64")),  # a dtype we never write
        lambda d: _with_header(d, lambda h: h.pop("__metadata__")),
        lambda d: b"\x04\x00\x00\x00\x00\x00\x00\x00[1] ",  # valid JSON, not a header
    ],
)
def test_a_buffer_that_is_not_a_state_we_wrote_is_refused(corrupt: object) -> None:
    from pipeline.engine.errors import KVMismatch

    with pytest.raises(KVMismatch):
        KVState.from_buffer(corrupt(_state().to_bytes()))  # type: ignore[operator]

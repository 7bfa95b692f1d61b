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
    back = KVState.from_bytes(data)
    assert back.request == request and back.model == "fingerprint"
    assert back.k.dtype == dtype and torch.equal(back.k, k) and torch.equal(back.v, v)

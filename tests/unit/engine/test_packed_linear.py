"""Weights reordered for oneDNN: the same products as F.linear, each row's result its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.engine.packed_linear import MIN_ROWS, linear
from tests.unit.engine.conftest import Loaded, make_engine


@pytest.mark.parametrize("rows", [1, 2, MIN_ROWS, 9, 17, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(896, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    bias = torch.randn(896, generator=gen) if with_bias else None
    packed = pack_one(weight)
    assert packed.layout == torch._mkldnn
    got = linear(x, packed, bias)
    assert got.shape == (rows, 896)
    assert torch.allclose(got, F.linear(x, weight, bias), atol=1e-3, rtol=1e-4)


def test_a_row_does_not_depend_on_the_other_rows_or_the_padding() -> None:
    # decode rows are padded to MIN_ROWS with zeros, and verification chunks batch k + 1 rows: the
    # token a sequence gets must not depend on who shares its step
    gen = torch.Generator().manual_seed(0)
    packed, x = pack_one(torch.randn(1536, 576, generator=gen)), torch.randn(1, 576, generator=gen)
    alone = linear(x, packed)
    for others in (1, 3, 8, 16):
        batch = torch.cat([x, torch.randn(others, 576, generator=gen)])
        assert torch.equal(linear(batch, packed)[:1], alone)


def test_a_plain_weight_goes_through_f_linear() -> None:
    weight, x = torch.randn(64, 32), torch.randn(3, 32)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_runner_packs_projections_and_lm_head_but_not_the_embedding(loaded: Loaded) -> None:
    packed = make_engine(loaded).runner.weights
    assert all(getattr(layer, name).layout == torch._mkldnn for layer in packed.layers for name in ("q", "k", "v", "o", "gate", "up", "down"))
    assert packed.lm_head.layout == torch._mkldnn
    assert packed.embed.layout == torch.strided and packed.layers[0].input_norm.layout == torch.strided
    plain = make_engine(loaded, packed_weights=False).runner.weights  # type: ignore[arg-type]
    assert plain.lm_head.layout == torch.strided and plain.layers[0].q.layout == torch.strided


def pack_one(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)

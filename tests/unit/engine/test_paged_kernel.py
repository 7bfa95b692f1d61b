"""The compiled decode-attention kernel against PyTorch's attention over the same keys and values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.engine.paged_kernel import paged_decode

BLOCK = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each sequence alone: its blocks in table order, its first `length` tokens, no mask."""
    out = []
    for row in range(q.shape[0]):
        n = int(lengths[row])
        blocks = tables[row, : -(-n // BLOCK)]
        keys = k[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, head_dim]
        values = v[blocks].flatten(0, 1)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[row, :, None], keys, values, enable_gqa=True, scale=q.shape[-1] ** -0.5)
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (14, 2, 80)])
def test_kernel_matches_attention_over_gathered_blocks(heads: int, kv_heads: int, head_dim: int) -> None:
    kernel = paged_decode()
    assert kernel is not None, "the kernel did not build on this machine (see the warning)"
    torch.manual_seed(0)
    lengths = torch.tensor([1, 15, 16, 17, 200, 333])  # block edges, a lone token, several blocks
    width = -(-int(lengths.max()) // BLOCK)
    num_blocks = len(lengths) * width + 4
    k = torch.randn(num_blocks, BLOCK, kv_heads, head_dim)
    v = torch.randn(num_blocks, BLOCK, kv_heads, head_dim)
    tables = torch.randperm(num_blocks)[: len(lengths) * width].view(len(lengths), width).contiguous()
    # slots past each length hold NaN, as never-written pool memory may: the kernel must not read them
    for row, n in enumerate(lengths.tolist()):
        for pos in range(n, width * BLOCK):
            k[tables[row, pos // BLOCK], pos % BLOCK] = float("nan")
            v[tables[row, pos // BLOCK], pos % BLOCK] = float("nan")
    q = torch.randn(len(lengths), heads, head_dim)
    got = kernel(q, k, v, tables, lengths, head_dim**-0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference(q, k, v, tables, lengths), atol=1e-5, rtol=1e-5)


def test_kernel_refuses_a_length_beyond_its_table() -> None:
    kernel = paged_decode()
    assert kernel is not None
    k = torch.zeros(4, BLOCK, 1, 8)
    with pytest.raises(RuntimeError, match="length out of range"):
        kernel(torch.zeros(1, 1, 8), k, k, torch.zeros(1, 1, dtype=torch.long), torch.tensor([BLOCK + 1]), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(torch.zeros(1, 1, 8), k, k, torch.tensor([[7]]), torch.tensor([3]), 1.0)

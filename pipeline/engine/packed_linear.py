"""Linear layers with their weights reordered once into oneDNN's blocked layout, on a CPU.

`F.linear` hands a weight to MKL's sgemm in its stored layout, and sgemm packs it again on every call:
for the few rows of a decode step that packing is most of the cost (SmolLM2-135M on this CPU, one
thread, a forward after 300 tokens of context: 49 ms for 1 row, 76 for 2, 99 for 9, 159 for 32).
Reordered once at load (`pack`), the same forwards take 39, 40, 57 and 118 ms, a 300-token chunk
0.99 s against 1.10 (`bench.packed_weights`; docs/benchmarks.md, "Weights packed for oneDNN"). Fewer than
MIN_ROWS rows are padded with zero rows to MIN_ROWS: oneDNN picks a slower kernel for one or two rows
than for four (44 and 55 ms against 38.5 ms for the whole forward; each row's result depends on its
own input only, so the padding changes nothing but the time).

The reordered weights serve only these calls: `linear` runs a packed weight through oneDNN and any
other through `F.linear`, so code that gets a plain tensor (CUDA, a torch without oneDNN, the switch
`EngineConfig.packed_weights = false`) runs as before.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pipeline.engine.llama import LlamaWeights

__all__ = ["linear", "pack"]

log = logging.getLogger(__name__)
MIN_ROWS = 4
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias): oneDNN for a packed weight, `F.linear` otherwise."""
    if weight.layout != torch._mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return out[:rows] if rows < MIN_ROWS else out


def pack(weights: LlamaWeights) -> LlamaWeights:
    """A copy of `weights` with every projection and the lm_head reordered for oneDNN (the embedding,
    norms and biases as they were); `weights` itself where this torch cannot (logged once)."""
    try:
        layers = tuple(
            dataclasses.replace(layer, **{name: _reorder(getattr(layer, name)) for name in _PROJECTIONS})
            for layer in weights.layers
        )
        return dataclasses.replace(weights, layers=layers, lm_head=_reorder(weights.lm_head))
    except (RuntimeError, AttributeError) as exc:  # no oneDNN in this build, or a dtype it does not take
        log.warning("weights not packed for oneDNN, projections run through F.linear: %s", str(exc)[:300])
        return weights


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

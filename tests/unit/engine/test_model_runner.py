"""The engine's own Llama forward against transformers: greedy tokens identical, batched and chunked."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.engine import model_runner
from pipeline.engine.errors import StepInterrupted
from pipeline.engine.params import EngineRequest
from tests.unit.engine.conftest import Loaded, chat_ids, make_engine

PROMPTS = [
    "Write a short poem about the sea.",
    "Hi",
    "Explain in a few sentences why the sky is blue, and what a rainbow is made of.",
]
N = 12


def reference(loaded: Loaded, ids: tuple[int, ...], n: int) -> list[int]:
    model = loaded[0]
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, do_sample=False,
            pad_token_id=2,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.parametrize(("kernel", "group"), [(True, 8), (False, 8), (False, 2)],
                         ids=["paged-kernel", "one-decode-group", "decodes-in-length-groups"])
def test_batched_greedy_equals_transformers_generate(
    loaded: Loaded, kernel: bool, group: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the torch path: with groups of 2 the three decodes are sorted by length and split ("Hi" and the
    # poem, then the long one), so rows are attended out of order and written back in place
    monkeypatch.setattr(model_runner, "DECODE_GROUP", group)
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    # a small token budget: the long prompt is prefilled in chunks while the others already decode
    engine = make_engine(loaded, max_num_batched_tokens=24, block_size=8, decode_kernel=kernel)
    assert (engine.runner._paged_decode is not None) == kernel, "the kernel did not build here (see the warning)"
    # the pool starts as whatever memory held: NaN there must not reach a token through masked slots
    engine.runner.k_cache.fill_(float("nan"))
    engine.runner.v_cache.fill_(float("nan"))
    got = engine.generate([EngineRequest(p, max_tokens=N, stop_token_ids=frozenset({2})) for p in prompts])
    assert got == [reference(loaded, p, N) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(("kernel", "packed"), [(True, True), (False, False)], ids=["paged-kernel-packed", "gathered-f-linear"])
def test_forward_tokens_scores_every_position_like_transformers(loaded: Loaded, kernel: bool, packed: bool) -> None:
    # chunks over earlier KV of a few tokens (speculative verification's shape) attend with the kernel,
    # one row per token, causal within the chunk; projections with weights packed for oneDNN or not
    ids = list(chat_ids(loaded, PROMPTS[0]))
    engine = make_engine(loaded, decode_kernel=kernel, packed_weights=packed)
    assert (engine.runner._paged_decode is not None) == kernel, "the kernel did not build here (see the warning)"
    seq = engine.scheduler.new_sequence(EngineRequest(tuple(ids), max_tokens=4))
    logits = engine.forward_tokens(seq, ids[:-3])
    more = engine.forward_tokens(seq, ids[-3:])
    with torch.inference_mode():
        expected = loaded[0](torch.tensor([ids])).logits[0].float()
    assert torch.allclose(torch.cat([logits, more]), expected, atol=1e-3)
    engine.truncate(seq, 5)
    again = engine.forward_tokens(seq, ids[-5:])
    assert torch.allclose(again, expected[-5:], atol=1e-3)
    assert seq.num_computed_tokens == len(ids)


def test_bfloat16_weights_keep_a_float32_pool_on_cpu_and_score_like_float32(loaded: Loaded) -> None:
    ids = list(chat_ids(loaded, PROMPTS[2]))
    scores = {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(loaded, dtype=dtype)  # type: ignore[arg-type]
        seq = engine.scheduler.new_sequence(EngineRequest(tuple(ids), max_tokens=4))
        scores[dtype] = torch.log_softmax(engine.forward_tokens(seq, ids), dim=-1)
    # weights in bfloat16 (half the bytes a step reads); K/V and attention in float32 on a CPU, where
    # PyTorch's bfloat16 attention is several times slower
    assert engine.runner.weights.layers[0].q.dtype == torch.bfloat16
    assert engine.runner.k_cache.dtype == engine.runner.v_cache.dtype == torch.float32
    full, half = scores["float32"], scores["bfloat16"]
    top = full.argmax(dim=-1, keepdim=True)
    assert (half.argmax(dim=-1) == top[:, 0]).float().mean() >= 0.9  # measured 0.97: a near-tie may flip
    assert (full.gather(1, top) - half.gather(1, top)).abs().mean() < 0.1  # measured 0.03 nats
    got = engine.generate([EngineRequest(chat_ids(loaded, p), max_tokens=6) for p in PROMPTS])  # batched decodes run
    assert [len(g) for g in got] == [6, 6, 6]


@pytest.mark.parametrize("set_at_layer", [3, -3], ids=["early-stops", "late-finishes"])
def test_an_interrupt_stops_a_step_only_in_its_first_half(
    loaded: Loaded, set_at_layer: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `interrupt_batch_steps` 0.5: set before layer 3 of 30, the step stops at the next check; set 3
    layers before the end, it finishes and samples what an uninterrupted step samples."""
    prompt = chat_ids(loaded, PROMPTS[0])
    plain = make_engine(loaded)
    plain.add_request(EngineRequest(prompt, max_tokens=2))
    expected = plain.execute(plain.scheduler.schedule())

    engine = make_engine(loaded, interrupt_batch_steps=0.5)  # type: ignore[arg-type]
    engine.add_request(EngineRequest(prompt, max_tokens=2))
    layers = len(engine.runner.weights.layers)
    interrupt, calls = threading.Event(), []
    mlp = model_runner.mlp

    def counting_mlp(*args: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == set_at_layer % layers:
            interrupt.set()
        return mlp(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner, "mlp", counting_mlp)
    output = engine.scheduler.schedule()
    if set_at_layer > 0:
        with pytest.raises(StepInterrupted):
            engine.execute(output, interrupt)
        assert len(calls) == set_at_layer  # it stopped before the next layer
    else:
        assert engine.execute(output, interrupt) == expected and len(calls) == layers

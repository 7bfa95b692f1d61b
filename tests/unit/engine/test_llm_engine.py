"""The engine loop: prefix-cache reuse, KV export and import, speculative-decoding hooks."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.config import EngineConfig, ModelConfig
from pipeline.engine.errors import KVMismatch
from pipeline.engine.kv_transfer import KVState
from pipeline.engine.llama import LlamaWeights
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.params import EngineRequest, SamplingParams
from pipeline.engine.sequence import SequenceStatus
from pipeline.models import convert_default_model
from tests.unit.engine.conftest import MODEL_CACHE, Loaded, chat_ids, make_engine

SYSTEM = "You are a helpful assistant who answers briefly and politely, in plain English. " * 3


def with_system(loaded: Loaded, question: str) -> tuple[int, ...]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tuple(int(t) for t in loaded[1].apply_chat_template(messages, add_generation_prompt=True))


def test_a_prefix_cache_hit_reuses_blocks_and_gives_identical_output(loaded: Loaded) -> None:
    engine = make_engine(loaded, block_size=8, max_num_batched_tokens=256)
    first = with_system(loaded, "What is 2+2?")
    second = with_system(loaded, "Name a colour.")
    cold = make_engine(loaded, block_size=8, max_num_batched_tokens=256).generate([EngineRequest(second, 8)])
    engine.generate([EngineRequest(first, 8)])
    hits_before = engine.block_manager.hit_blocks
    seq = engine.add_request(EngineRequest(second, 8))
    while engine.has_unfinished():
        engine.step()
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # shared leading tokens
    assert engine.block_manager.hit_blocks - hits_before == common // 8 > 0
    assert seq.num_cached_tokens == common // 8 * 8
    assert seq.completion_ids == cold[0]


def test_export_then_import_continues_identically(loaded: Loaded) -> None:
    prompt = chat_ids(loaded, "Tell me about the moon.")
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    whole = make_engine(loaded).generate([EngineRequest(prompt, 10, sampling=sampling)])[0]

    source = make_engine(loaded)
    seq = source.add_request(EngineRequest(prompt, 10, sampling=sampling), park_after_first=True)
    while seq.status is not SequenceStatus.PARKED:
        source.step()
    data = source.export_kv(seq).to_bytes()
    source.abort(seq)
    assert source.block_manager.num_free_blocks == source.block_manager.num_blocks

    target = make_engine(loaded, block_size=4)  # a different block layout is fine: KV travels per token
    moved = target.import_kv(KVState.from_buffer(data))
    assert moved.completion_ids == whole[:1]
    target.scheduler.unpark(moved)
    while target.has_unfinished():
        target.step()
    assert moved.completion_ids == whole


TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True,
)


def tiny_engine(seed: int) -> LLMEngine:
    weights = LlamaWeights.random(TINY, "cpu", torch.float32, seed=seed)
    return LLMEngine(ModelRunner(TINY, weights, EngineConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64)))


def test_kv_of_other_weights_of_the_same_shape_is_refused_and_never_cached() -> None:
    source, other = tiny_engine(seed=0), tiny_engine(seed=1)  # a fine-tune of the same architecture
    seq = source.add_request(EngineRequest(tuple(range(1, 14)), 4), park_after_first=True)
    while seq.status is not SequenceStatus.PARKED:
        source.step()
    state = KVState.from_buffer(source.export_kv(seq).to_bytes())
    with pytest.raises(KVMismatch):
        other.import_kv(state, seq.to_request())
    assert other.block_manager.num_free_blocks == other.block_manager.num_blocks
    other.generate([EngineRequest(state.request.prompt_ids, 1)])  # computes its own KV: none of source's was cached
    assert other.block_manager.hit_blocks == 0
    same = tiny_engine(seed=0)  # the same weights loaded again: the state fits
    assert same.import_kv(state, seq.to_request()).num_computed_tokens == 13


def test_the_weights_digest_is_the_same_loaded_from_disk_or_shared_by_transformers(loaded: Loaded) -> None:
    shared = make_engine(loaded)
    read = LLMEngine(ModelRunner.from_path(convert_default_model(MODEL_CACHE), shared.config))
    assert read.model_fingerprint == shared.model_fingerprint


def test_a_staged_export_equals_a_fresh_one_until_the_next_staged_export(loaded: Loaded) -> None:
    engine = make_engine(loaded, block_size=4)
    seqs = []
    for text in ("Tell me about the moon, please.", "Hi"):
        seq = engine.add_request(EngineRequest(chat_ids(loaded, text), 4), park_after_first=True)
        while seq.status is not SequenceStatus.PARKED:
            engine.step()
        seqs.append(seq)
    fresh = engine.export_kv(seqs[0])
    staged = engine.export_kv(seqs[0], staged=True)
    assert torch.equal(staged.k, fresh.k) and torch.equal(staged.v, fresh.v)
    assert staged.k.is_contiguous() and staged.k.shape[1] == seqs[0].num_computed_tokens
    assert seqs[0].num_computed_tokens % 4 != 0  # the last block is read in part
    engine.export_kv(seqs[1], staged=True)  # the shorter one reuses the buffer, from its start
    assert not torch.equal(staged.k, fresh.k)


def test_append_tokens_stops_at_max_tokens_and_frees_blocks(loaded: Loaded) -> None:
    engine = make_engine(loaded)
    seq = engine.add_request(EngineRequest((1, 2, 3), 3), park_after_first=True)
    while seq.status is not SequenceStatus.PARKED:
        engine.step()
    assert engine.append_tokens(seq, [5, 6, 7]) == [5, 6]
    assert seq.status is SequenceStatus.FINISHED
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_target_rolls_back_like_a_fresh_forward(loaded: Loaded) -> None:
    from pipeline.engine.engine_target import EngineTarget

    ids = list(chat_ids(loaded, "Say something."))
    engine = make_engine(loaded, block_size=4)
    target = EngineTarget(engine)
    full = target.forward_tokens(ids)
    target.truncate(len(ids) - 6)  # keep all but the last six positions
    again = target.forward_tokens(ids[-6:])
    assert (again.argmax(-1) == full[-6:].argmax(-1)).all()
    target.truncate(0)
    target.close()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

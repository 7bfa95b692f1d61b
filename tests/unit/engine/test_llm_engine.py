"""The engine loop: prefix-cache reuse, KV export and import, speculative-decoding hooks."""

from __future__ import annotations

import torch

from pipeline.engine.kv_transfer import KVState
from pipeline.engine.params import EngineRequest, SamplingParams
from pipeline.engine.sequence import SequenceStatus
from tests.unit.engine.conftest import Loaded, chat_ids, make_engine

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

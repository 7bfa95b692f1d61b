"""Speculative decoding inside the engine's batched decode steps (scheduler.py, verify.py): the same
tokens as plain batched decoding under greedy, fewer steps, exact cuts at stop tokens and max_tokens,
rollback that leaves the KV pool and the prefix cache as plain decoding would, cancellation at once."""

from __future__ import annotations

from dataclasses import replace

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.params import EngineRequest, SamplingParams, SpeculativeParams
from pipeline.engine.scheduler import SchedulerOutput, StepTokens
from pipeline.engine.sequence import Sequence, SequenceStatus
from tests.unit.engine.conftest import Loaded, chat_ids, make_engine

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the small village, and the children "
    "were playing near the old stone bridge while their parents watched from the market square."
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
EOS = 2
SPEC = SpeculativeParams(num_draft_tokens=4)


def workload(loaded: Loaded) -> list[EngineRequest]:
    """Five prompts: three that copy from their input (drafts get accepted), two that do not; different
    lengths, max_tokens and stop tokens."""
    texts = [
        ("Repeat the following text exactly, word for word:\n\n" + PARAGRAPH, 48),
        ("Write a short poem about the sea.", 24),
        ("Copy this Python code exactly:\n\n" + CODE, 40),
        ("What is the capital of France?", 12),
        ("Correct the spelling and write the text out again:\n\nThe quick brwn fox jumps ovr the lazy dog.", 30),
    ]
    return [EngineRequest(chat_ids(loaded, t), max_tokens=m, stop_token_ids=frozenset({EOS})) for t, m in texts]


Steps = list[tuple[SchedulerOutput, list[StepTokens]]]


def run(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[list[Sequence], Steps]:
    """Every request to the end; the sequences and each step's chunks and results."""
    steps: Steps = []
    execute = engine.execute

    def spy(output: SchedulerOutput) -> list[StepTokens]:
        result = execute(output)
        steps.append((output, result))
        return result

    engine.execute = spy  # type: ignore[method-assign]
    seqs = [engine.add_request(r) for r in requests]
    while engine.has_unfinished():
        engine.step()
    return seqs, steps


def valid_hashes(bm: BlockManager, seqs: list[Sequence]) -> set[bytes]:
    """The hash of every full block of every sequence's final tokens (what the cache may hold)."""
    found = set()
    for seq in seqs:
        parent = b""
        for end in range(bm.block_size, len(seq.token_ids) + 1, bm.block_size):
            parent = bm.block_hash(parent, seq.salt, seq.token_ids[end - bm.block_size : end])
            found.add(parent)
    return found


def test_speculative_batched_output_equals_plain_under_greedy(loaded: Loaded) -> None:
    requests = workload(loaded)
    plain_engine = make_engine(loaded, block_size=8)
    plain, plain_steps = run(plain_engine, requests)
    # a stop token inside the copied paragraph, where drafts run: that sequence must end exactly there
    copied = plain[0].completion_ids
    stop_at = next(i for i in range(12, len(copied)) if copied[i] not in copied[:i])
    requests[0] = replace(requests[0], stop_token_ids=frozenset({EOS, copied[stop_at]}))
    plain_engine = make_engine(loaded, block_size=8)
    plain, plain_steps = run(plain_engine, requests)
    assert plain[0].completion_ids == copied[: stop_at + 1]

    spec_engine = make_engine(loaded, block_size=8)
    spec, spec_steps = run(spec_engine, [replace(r, speculative=SPEC) for r in requests])

    assert [s.completion_ids for s in spec] == [s.completion_ids for s in plain]
    assert all(s.status is SequenceStatus.FINISHED for s in spec)
    scheduler = spec_engine.scheduler
    assert 0 < scheduler.spec_accepted <= scheduler.spec_proposed
    assert len(spec_steps) < len(plain_steps)
    # verification ran in the same forward as other sequences' plain decodes
    def mixed(out: SchedulerOutput) -> bool:
        return any(c.num_drafts for c in out.chunks) and any(len(c.token_ids) == 1 for c in out.chunks)

    assert any(mixed(out) for out, _ in spec_steps)
    # the stopped sequence's last step accepted more tokens than it kept: it finished mid-draft
    last = [(c, r) for out, res in spec_steps for c, r in zip(out.chunks, res, strict=True) if c.seq is spec[0]][-1]
    assert last[0].num_drafts and isinstance(last[1], tuple) and len(last[1]) > spec[0].num_new_tokens
    for engine, seqs in ((plain_engine, plain), (spec_engine, spec)):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert set(bm._by_hash) <= valid_hashes(bm, seqs)  # no draft that was rolled back is cached
    assert set(spec_engine.block_manager._by_hash) == set(plain_engine.block_manager._by_hash)


def test_cancelling_a_speculative_sequence_mid_step_stops_it_at_once(loaded: Loaded) -> None:
    engine = make_engine(loaded, block_size=8)
    requests = [replace(r, speculative=SPEC) for r in workload(loaded)[:3]]
    target, *others = [engine.add_request(r) for r in requests]
    for _ in range(40):  # until a step verifies drafts for the target
        output = engine.scheduler.schedule()
        if any(c.seq is target and c.num_drafts for c in output.chunks):
            break
        engine.scheduler.update_from_output(output, engine.execute(output))
    else:
        raise AssertionError("the target never drafted")
    before = list(target.token_ids)
    sampled = engine.execute(output)
    assert engine.abort(target)  # lands while the step's result is on its way
    progressed = engine.scheduler.update_from_output(output, sampled)
    assert target not in progressed and target.token_ids == before and target.status is SequenceStatus.ABORTED
    while engine.has_unfinished():
        output = engine.scheduler.schedule()
        assert all(c.seq is not target for c in output.chunks)
        engine.scheduler.update_from_output(output, engine.execute(output))
    assert target.token_ids == before and all(s.status is SequenceStatus.FINISHED for s in others)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_temperature_runs_respects_max_tokens_and_stops_and_is_reproducible(loaded: Loaded) -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=11)
    requests = [replace(r, speculative=SPEC, sampling=sampling) for r in workload(loaded)]
    outputs = []
    for _ in range(2):
        engine = make_engine(loaded, block_size=8)
        seqs, _ = run(engine, requests)
        outputs.append([s.completion_ids for s in seqs])
        assert engine.scheduler.spec_accepted > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        for seq, request in zip(seqs, requests, strict=True):
            completion = seq.completion_ids
            assert 0 < len(completion) <= request.max_tokens
            assert EOS not in completion[:-1]  # nothing after a stop token
            assert len(completion) == request.max_tokens or completion[-1] == EOS
    assert outputs[0] == outputs[1]


def test_seeded_sampling_gives_the_same_tokens_with_or_without_drafts_under_any_budget(loaded: Loaded) -> None:
    """Under temperature a seeded request's tokens are plain decoding's, however many drafts each step
    had room for: verification draws each row as plain decoding draws that completion index. Before,
    one generator per step was spent on the drafts' uniform draws, so the tokens followed the budget
    and the other requests' load (and a recompute after a handoff could differ from the original)."""
    sampling = SamplingParams(temperature=0.7, seed=1234)
    requests = [replace(r, sampling=sampling) for r in workload(loaded)[:3]]
    plain, _ = run(make_engine(loaded, block_size=8), requests)
    speculative = [replace(r, speculative=SPEC) for r in requests]
    roomy_engine = make_engine(loaded, block_size=8, max_num_batched_tokens=256)
    roomy, _ = run(roomy_engine, speculative)
    tight, tight_steps = run(make_engine(loaded, block_size=8, max_num_batched_tokens=4), speculative)
    assert roomy_engine.scheduler.spec_accepted > 0
    assert any(c.num_drafts for out, _ in tight_steps for c in out.chunks)  # the tight budget still drafted
    assert [s.completion_ids for s in tight] == [s.completion_ids for s in roomy]
    assert [s.completion_ids for s in roomy] == [s.completion_ids for s in plain]

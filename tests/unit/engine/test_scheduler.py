"""Scheduler: a property test over random arrivals, cancellations, parking and preemption (no model:
a fake runner samples token ids), plus the lanes' policy."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.params import EngineRequest, Priority, SpeculativeParams
from pipeline.engine.scheduler import Scheduler, SchedulerOutput, StepTokens
from pipeline.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 12, block_size: int = 4, **limits: int) -> Scheduler:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, **limits)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size), max_model_len=1000)


def fake_run(output: SchedulerOutput, rng: random.Random) -> list[StepTokens]:
    """A random token per sampling chunk; for a chunk with drafts, a random number of them kept, then one."""
    return [
        (*c.token_ids[1 : 1 + rng.randint(0, c.num_drafts)], rng.randrange(8)) if c.num_drafts
        else rng.randrange(8) if c.sample else None
        for c in output.chunks
    ]


def check_invariants(s: Scheduler, live: list[Sequence]) -> None:
    bm = s.block_manager
    refs = [0] * bm.num_blocks
    for seq in live:
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.PARKED):
            for b in seq.block_table:
                refs[b] += 1
            assert seq.num_computed_tokens < len(seq.token_ids)
        else:
            assert not seq.block_table
    assert [b.ref_count for b in bm.blocks] == refs
    assert all(b.ref_count >= 0 for b in bm.blocks)
    assert bm.num_free_blocks == refs.count(0)


ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "cancel", "unpark"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, budget=st.integers(1, 24), block_size=st.integers(1, 6))
def test_random_workloads_free_every_block(ops: list[tuple[str, int]], budget: int, block_size: int) -> None:
    s = make(num_blocks=10, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=4, max_parked=2)
    rng = random.Random(0)
    live: list[Sequence] = []
    preemptions = 0
    for op, arg in ops:
        r = random.Random(arg)
        if op == "add":
            prompt = tuple(r.choice([1, 2]) for _ in range(r.randint(1, 3 * block_size)))  # shared prefixes
            request = EngineRequest(prompt, max_tokens=r.randint(1, 6), salt=r.choice(["", "t"]),
                                    priority=r.choice(list(Priority)),
                                    stop_token_ids=r.choice([frozenset(), frozenset({7})]),
                                    speculative=r.choice([None, SpeculativeParams(r.randint(1, 4))]))
            if s.block_manager.blocks_for(len(prompt) + request.max_tokens) <= 10:
                live.append(s.add(request, park_after_first=r.random() < 0.3))
        elif op == "step":
            out = s.schedule()
            assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks) <= budget
            preemptions += len(out.preempted)
            if live and r.random() < 0.2:  # a cancel lands while the step runs
                s.abort(r.choice(live))
            s.update_from_output(out, fake_run(out, rng))
        elif op == "cancel" and live:
            s.abort(r.choice(live))
        elif op == "unpark" and s.parked:
            s.unpark(next(iter(s.parked.values())))
        check_invariants(s, live)
    for _ in range(500):  # drain: everything left finishes
        for seq in list(s.parked.values()):
            s.unpark(seq)
        if not s.num_unfinished:
            break
        out = s.schedule()
        s.update_from_output(out, fake_run(out, rng))
        check_invariants(s, live)
    assert not s.num_unfinished and not s.parked
    assert all(seq.is_done for seq in live)
    for seq in live:  # nothing past max_tokens or after a stop token, however many tokens a step gave
        assert seq.num_completion_tokens <= seq.max_tokens
        assert not set(seq.completion_ids[:-1]) & seq.stop_token_ids
    assert s.block_manager.num_free_blocks == 10 and all(b.ref_count == 0 for b in s.block_manager.blocks)


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = make(num_blocks=4, block_size=2, max_num_batched_tokens=100)
    a = s.add(EngineRequest((1, 2, 3), max_tokens=5))
    b = s.add(EngineRequest((4, 5, 6), max_tokens=5))
    rng = random.Random(1)
    seen_preempted = []
    for _ in range(40):
        if not s.num_unfinished:
            break
        out = s.schedule()
        seen_preempted += out.preempted
        s.update_from_output(out, fake_run(out, rng))
    assert b in seen_preempted and b.preemptions >= 1  # the later arrival gives way
    assert a.status is SequenceStatus.FINISHED and b.status is SequenceStatus.FINISHED
    assert a.num_completion_tokens == 5 and b.num_completion_tokens == 5


def test_long_prompts_are_chunked_under_the_budget_and_mixed_with_decodes() -> None:
    s = make(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    short = s.add(EngineRequest((1, 2), max_tokens=10))
    s.update_from_output(out := s.schedule(), [7])
    long = s.add(EngineRequest(tuple(range(20)), max_tokens=2))
    out = s.schedule()
    assert [(c.seq, len(c.token_ids), c.sample) for c in out.chunks] == [(short, 1, True), (long, 7, False)]
    assert out.num_batched_tokens == 8


def test_batch_lane_waits_for_interactive_but_ages_in_on_its_own_step() -> None:
    s = make(num_blocks=64, block_size=4, max_num_seqs=1, aging_steps=3, batch_every=4)
    batch = s.add(EngineRequest((1, 2), max_tokens=50, priority=Priority.BATCH))
    inter = [s.add(EngineRequest((3, 4), max_tokens=1)) for _ in range(12)]
    admitted = []
    for _ in range(8):
        out = s.schedule()
        admitted.append([c.seq for c in out.chunks if c.start == 0])
        s.update_from_output(out, [0] * len(out.chunks))
    # steps 1-3 yield to the waiting interactive requests; on step 4, the batch lane's, the aged batch
    # request goes ahead of them (without aging, an interactive one would take the single seat)
    assert admitted[:3] == [[inter[0]], [inter[1]], [inter[2]]] and admitted[3] == [batch]
    assert batch.status is SequenceStatus.RUNNING


def test_an_aged_batch_request_does_not_start_on_a_step_where_the_lane_yields() -> None:
    s = make(num_blocks=64, block_size=4, batch_every=4, aging_steps=1)
    inter = s.add(EngineRequest((3, 4), max_tokens=100))
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # step 1: inter's prefill
    aged = s.add(EngineRequest(tuple(range(10, 30)), max_tokens=5, priority=Priority.BATCH))
    s.step_count += 1  # step 2 passes: `aged` has waited past aging_steps
    out = s.schedule()  # step 3: interactive work runs, the batch lane yields
    assert [c.seq for c in out.chunks] == [inter] and aged.status is SequenceStatus.WAITING
    s.update_from_output(out, [0 for _ in out.chunks])
    out = s.schedule()  # step 4: the batch lane's
    assert {c.seq for c in out.chunks} == {inter, aged}


def test_different_tenants_do_not_share_blocks() -> None:
    s = make(num_blocks=64, block_size=2)
    rng = random.Random(2)
    first = s.add(EngineRequest(tuple(range(9)), max_tokens=1, salt="a"))
    while s.num_unfinished:
        out = s.schedule()
        s.update_from_output(out, fake_run(out, rng))
    other = s.add(EngineRequest(tuple(range(9)), max_tokens=1, salt="b"))
    same = s.add(EngineRequest(tuple(range(9)), max_tokens=1, salt="a"))
    s.schedule()
    assert first.status is SequenceStatus.FINISHED
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 8


def test_the_scheduler_and_block_manager_never_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, pipeline.engine.scheduler, pipeline.engine.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_batch_lane_yields_to_interactive_work_but_runs_every_nth_step() -> None:
    s = make(num_blocks=64, block_size=4, batch_every=4)
    batch = [s.add(EngineRequest((1, 2), max_tokens=100, priority=Priority.BATCH)) for _ in range(3)]
    fed: list[set[int]] = []
    for step in range(8):
        if step == 2:
            inter = s.add(EngineRequest((3, 4), max_tokens=100))
        out = s.schedule()
        fed.append({c.seq.seq_id for c in out.chunks})
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])
    batch_ids = {b.seq_id for b in batch}
    assert fed[0] == fed[1] == batch_ids  # alone, the batch lane runs every step
    assert fed[2] == {inter.seq_id}  # step 3: the arriving interactive request's prefill gets a step of its own
    # steps 4..8 (step_count 4..8): the batch lane only on step_count 4 and 8, the interactive one every step
    assert [batch_ids <= f for f in fed[3:]] == [True, False, False, False, True]
    assert all(inter.seq_id in f for f in fed[3:])


def test_a_batch_request_is_not_admitted_on_a_yielding_step_unless_it_aged() -> None:
    s = make(num_blocks=64, block_size=4, batch_every=4, aging_steps=50)
    inter = s.add(EngineRequest((3, 4), max_tokens=100))
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # step 1
    late = s.add(EngineRequest((1, 2), max_tokens=5, priority=Priority.BATCH))
    admitted_at = None
    for _ in range(6):
        out = s.schedule()
        if any(c.seq is late for c in out.chunks) and admitted_at is None:
            admitted_at = s.step_count
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])
    assert admitted_at == 4 and inter.status is SequenceStatus.RUNNING


def test_batch_prompts_are_fed_in_small_chunks_with_or_without_interactive_work() -> None:
    s = make(num_blocks=128, block_size=4, batch_every=1, batch_prompt_tokens=8, max_num_batched_tokens=64)
    alone = s.add(EngineRequest(tuple(range(100, 140)), max_tokens=30, priority=Priority.BATCH))
    fed = []
    while alone.num_computed_tokens < alone.num_prompt_tokens:  # no interactive work: the cap holds too
        out = s.schedule()
        fed.append(len(out.chunks[0].token_ids))
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])
    assert fed == [8, 8, 8, 8, 8]
    inter = s.add(EngineRequest((3, 4), max_tokens=100))
    batch = [s.add(EngineRequest(tuple(range(200 + 50 * i, 221 + 50 * i + i)), max_tokens=2, priority=Priority.BATCH))
             for i in range(2)]
    prompt_chunks: dict[int, list[int]] = {b.seq_id: [] for b in batch}
    while any(b.status is not SequenceStatus.FINISHED for b in batch):
        out = s.schedule()
        chunks = {c.seq.seq_id: c for c in out.chunks}
        assert inter.seq_id in chunks and alone.seq_id in chunks  # decodes are never held back by the cap
        for b in batch:
            if b.seq_id in chunks and chunks[b.seq_id].start < b.num_prompt_tokens:
                prompt_chunks[b.seq_id].append(len(chunks[b.seq_id].token_ids))
        assert sum(len(c.token_ids) for c in out.chunks if c.seq in batch and c.start < c.seq.num_prompt_tokens) <= 8
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])
    for b in batch:  # fed in chunks of at most 8 while `inter` ran, every prompt token once
        assert max(prompt_chunks[b.seq_id]) <= 8 and sum(prompt_chunks[b.seq_id]) == b.num_prompt_tokens


def test_an_interactive_request_preempts_batch_sequences_that_hold_every_block() -> None:
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64, batch_every=4)
    batch = [s.add(EngineRequest(tuple(range(20 * i, 20 * i + 16)), max_tokens=10, priority=Priority.BATCH)) for i in range(2)]
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # 2 prompts of 16 tokens: all 8 blocks
    assert s.block_manager.num_free_blocks == 0
    inter = s.add(EngineRequest((1, 2, 3, 4, 5), max_tokens=3))
    out = s.schedule()
    assert [c.seq for c in out.chunks] == [inter]  # admitted at once, not after a batch sequence finishes
    assert out.preempted == (batch[1],) and batch[1].status is SequenceStatus.WAITING  # the later arrival gave way
    assert batch[0].status is SequenceStatus.RUNNING
    rng = random.Random(3)
    s.update_from_output(out, fake_run(out, rng))
    while s.num_unfinished:
        out = s.schedule()
        s.update_from_output(out, fake_run(out, rng))
    assert all(b.num_completion_tokens == 10 for b in batch) and inter.num_completion_tokens == 3


def test_an_aged_batch_request_that_cannot_start_does_not_hold_back_an_interactive_one() -> None:
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64, aging_steps=1)
    batch = [s.add(EngineRequest(tuple(range(20 * i, 20 * i + 15)), max_tokens=10, priority=Priority.BATCH)) for i in range(2)]
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # 2 x (15 + 1) tokens: all 8 blocks taken
    queued = s.add(EngineRequest(tuple(range(50, 62)), max_tokens=4, priority=Priority.BATCH))
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # `queued` ages, waiting for blocks
    assert not out.preempted and s.block_manager.num_free_blocks == 0
    inter = s.add(EngineRequest((1, 2, 3), max_tokens=3))
    out = s.schedule()
    assert inter in [c.seq for c in out.chunks] and queued.status is SequenceStatus.WAITING
    assert out.preempted == (batch[1],)  # the room came from a running batch sequence, not from `queued`


def test_no_batch_request_starts_while_the_lane_is_held_for_a_due_decode_even_an_aged_one() -> None:
    s = make(num_blocks=64, block_size=4, aging_steps=1)
    aged = s.add(EngineRequest((1, 2, 3), max_tokens=5, priority=Priority.BATCH))
    s.step_count += 5  # it waited past aging_steps
    out = s.schedule(hold_batch=True)
    assert out.is_empty and aged.status is SequenceStatus.WAITING  # the step the decode would wait behind never starts
    out = s.schedule()
    assert [c.seq for c in out.chunks] == [aged]  # unheld, it starts


def test_an_interactive_request_takes_a_batch_sequences_seat_and_a_batch_one_waits() -> None:
    s = make(num_blocks=64, block_size=4, max_num_seqs=2, aging_steps=1000)
    batch = [s.add(EngineRequest((1, 2), max_tokens=50, priority=Priority.BATCH)) for _ in range(2)]
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])
    inter = s.add(EngineRequest((3, 4), max_tokens=5))
    out = s.schedule()
    assert inter in [c.seq for c in out.chunks] and out.preempted == (batch[1],)
    s.update_from_output(out, [0 for _ in out.chunks])
    late = s.add(EngineRequest((5, 6), max_tokens=5, priority=Priority.BATCH))  # a batch request never preempts
    for _ in range(3):
        out = s.schedule()
        assert not out.preempted and late not in [c.seq for c in out.chunks]
        s.update_from_output(out, [0 for _ in out.chunks])


def test_batch_every_one_is_the_old_policy() -> None:
    s = make(num_blocks=64, block_size=4, batch_every=1)
    s.add(EngineRequest((3, 4), max_tokens=100))
    batch = s.add(EngineRequest((1, 2), max_tokens=100, priority=Priority.BATCH))
    for _ in range(5):
        out = s.schedule()
        assert batch in [c.seq for c in out.chunks]
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])


def test_drafts_take_only_free_blocks_and_roll_back_what_verification_rejects() -> None:
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = s.add(EngineRequest((1, 2, 3, 1, 2, 3, 1), max_tokens=8, speculative=SpeculativeParams(4)))
    s.update_from_output(s.schedule(), [2])  # prefill: 7 tokens in 2 blocks, then token 2
    b = s.add(EngineRequest((5, 6, 7, 8, 9), max_tokens=3))
    out = s.schedule()  # b takes the last two blocks: a decodes without drafts, and nobody is preempted
    assert [(c.seq, c.num_drafts) for c in out.chunks] == [(a, 0), (b, 0)] and not out.preempted
    s.update_from_output(out, [3, 9])
    s.abort(b)
    out = s.schedule()  # (1, 2, 3) occurred before, followed by 1, 2, 3: three drafts, one more block
    [chunk] = out.chunks
    assert chunk.token_ids == (3, 1, 2, 3) and chunk.num_drafts == 3 and chunk.start == 8
    assert len(a.block_table) == 3 and s.block_manager.num_free_blocks == 1
    s.update_from_output(out, [(1, 2, 5)])  # two drafts kept, then the target's own token
    assert a.completion_ids == [2, 3, 1, 2, 5] and a.num_new_tokens == 3
    assert a.num_computed_tokens == len(a.token_ids) - 1 == 11  # the rejected draft's KV is gone
    assert (s.spec_proposed, s.spec_accepted) == (3, 2)
    rng = random.Random(3)
    while s.num_unfinished:
        out = s.schedule()
        s.update_from_output(out, fake_run(out, rng))
    assert a.status is SequenceStatus.FINISHED and a.num_completion_tokens == 8
    assert s.block_manager.num_free_blocks == 4


def test_holding_the_batch_lane_leaves_a_step_empty_rather_than_run_batch_work() -> None:
    s = make(num_blocks=64, block_size=4, batch_every=4)
    s.add(EngineRequest((1, 2), max_tokens=100, priority=Priority.BATCH))
    assert s.schedule(hold_batch=True).is_empty  # a decode is due: no full batch step for it to wait behind
    inter = s.add(EngineRequest((3, 4), max_tokens=100))
    out = s.schedule(hold_batch=True)
    assert [c.seq for c in out.chunks] == [inter]
    s.update_from_output(out, [0 for _ in out.chunks])
    s.update_from_output(out := s.schedule(), [0 for _ in out.chunks])  # step 3: the batch lane yields
    assert len(out.chunks) == 1 and s.step_count == 3
    s.update_from_output(out := s.schedule(), [0 if c.sample else None for c in out.chunks])
    assert len(out.chunks) == 2  # not held: step 4 is the batch lane's
    assert s.schedule(hold_batch=True).chunks[0].seq is inter  # held: only interactive work


def test_a_step_shared_with_interactive_work_takes_fewer_batch_prompt_tokens() -> None:
    s = make(num_blocks=128, block_size=4, batch_every=2, batch_prompt_tokens=8, shared_prompt_tokens=2,
             max_num_batched_tokens=64)
    batch = s.add(EngineRequest(tuple(range(100, 140)), max_tokens=5, priority=Priority.BATCH))
    out = s.schedule()  # step 1, alone: the batch lane's cap
    assert [len(c.token_ids) for c in out.chunks] == [8]
    s.update_from_output(out, [None])
    inter = s.add(EngineRequest((3, 4), max_tokens=100))
    fed: list[tuple[bool, int]] = []
    for _ in range(4):  # steps 2..5: shared on even steps (batch_every 2), interactive-only on odd ones
        out = s.schedule()
        chunks = {c.seq.seq_id: len(c.token_ids) for c in out.chunks}
        fed.append((inter.seq_id in chunks, chunks.get(batch.seq_id, 0)))
        s.update_from_output(out, [0 if c.sample else None for c in out.chunks])
    assert fed == [(True, 2), (True, 0), (True, 2), (True, 0)]

"""Which tokens of which sequences the next step computes (pure bookkeeping: no torch).

Two-phase contract, as in vLLM v1:

    out = scheduler.schedule()                      # decide; blocks are allocated here
    sampled = model_runner.run(out)                 # compute (possibly in another thread)
    done = scheduler.update_from_output(out, sampled)  # account; finished sequences free their blocks

Policy: running sequences first (interactive lane, then batch, oldest first), each fed all its
uncomputed tokens up to what is left of the step's token budget (a decode is one token, a long
prompt is fed in chunks over several steps). When blocks run out, parked sequences are dropped
first, then the running sequence of the lowest lane that arrived last is preempted: its blocks are
freed and it goes back to the front of its waiting lane, to be recomputed (its full blocks usually
come straight back from the prefix cache). Waiting sequences are admitted while budget, batch size
and blocks allow, interactive first, except that on the batch lane's steps a batch request waiting
`aging_steps` steps or more goes ahead of waiting interactive ones, so batch work is never starved
(on a step where the batch lane yields, no batch request starts, aged or not: a preempted request is
aged at once, and with long batch prompts its prompt chunk in nearly every interactive step made those
steps several times slower; its later chunks would wait for the lane's steps anyway). An interactive
request that finds no free blocks or no free seat preempts running batch-lane sequences (the last arrived first)
until it fits: otherwise a backfill of long prompts that fills the KV pool would hold it back until
batch sequences finish, tens of seconds on a CPU (docs/benchmarks.md, "long prompts").

Batch work yields to interactive work step by step: while an interactive sequence is running or
waiting, the batch lane is fed (and admitted) only on every `batch_every`-th step, so on a device where a step costs
more the more sequences it holds (a CPU), a backfill slows interactive answers by about
(batch_every - 1 + cost of a full step / cost of an interactive one) / batch_every instead of the full
step's cost; a step that would otherwise compute nothing feeds the batch lane anyway, unless the
caller holds the batch lane because an interactive sequence's decode is due any moment (AsyncEngine:
between a prefill and its decode, `handoff_hold_ms`), so that its first decode step does not wait
behind a full batch step. The batch lane's prompt tokens (the prefill chunks of its newly admitted or
preempted sequences) are capped per step (`batch_prompt_tokens`), with or without interactive work: a
step an interactive sequence shares, or arrives during and waits for, then costs about what its
decodes cost, not a few hundred prompt tokens more (a long batch prompt is fed in more, smaller chunks;
on this CPU a 512-token batch step took 1.6-1.9 s, a capped one at most 0.4 s, for 5-8% less
backfill throughput on long prompts: docs/benchmarks.md, "long prompts"); in a step interactive work
shares (every `batch_every`-th while it is present) the cap is the smaller `shared_prompt_tokens`
(16): there a 64-token chunk cost about 200 ms on this CPU, more than two interactive steps, and
every interactive request meets such a step; the rest of a prompt goes in on the batch lane's own
steps, which an interactive arrival stops (AsyncEngine), or in more small chunks. Without
interactive work the batch lane runs every step.

Speculative decoding (a request with `speculative` set): once every running sequence has its chunk
and waiting ones are admitted, each decode of such a sequence is extended with up to k drafts from
n-gram prompt lookup (`NGramProposer` over its tokens so far, k from its `AdaptiveDraftLength`, cut to
the budget left and to max_tokens), if blocks for the drafts are free; otherwise it decodes plainly
this step (drafts never preempt, delay or displace other work). The runner scores every position of
such a chunk and returns the tokens it accepts (1..k+1); `update_from_output` appends them up to a
stop token or max_tokens and rolls the rejected drafts' KV back (`BlockManager.truncate`: the
sequence's length and block table shrink, freed blocks return to the pool, and only blocks whose
tokens are final are ever registered in the prefix cache).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.drafting import NGramProposer
from pipeline.engine.errors import RequestTooLarge
from pipeline.engine.params import EngineRequest, Priority
from pipeline.engine.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput", "StepTokens"]

# What the runner gives back for one chunk: None (no sample: a prefill chunk short of the prompt's end),
# one sampled token, or for a chunk with drafts the tokens verification accepted (drafts kept, then one
# token of the target's own).
StepTokens = int | tuple[int, ...] | None


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step, snapshotted so the model may run while the event loop moves on."""

    seq: Sequence  # the sequence (the runner reads only its sampling fields and, for penalties, its tokens)
    start: int  # position of the first fed token (= the sequence's computed tokens before the step)
    token_ids: tuple[int, ...]  # tokens fed this step, at positions start .. start + len - 1
    block_table: tuple[int, ...]  # the sequence's blocks, covering at least start + len positions
    sample: bool  # True when the chunk reaches the sequence's last token: sample one new token
    completion_index: int  # completion index of the token sampled (seeds reproducible sampling)
    num_drafts: int = 0  # token_ids[1:] are drafts to verify: score every position, accept 1..num_drafts + 1 tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes, decode chunks first (their order is the order of `sampled` results)."""

    chunks: tuple[ScheduledChunk, ...]  # every sequence fed this step
    num_batched_tokens: int  # sum of len(chunk.token_ids): at most max_num_batched_tokens
    preempted: tuple[Sequence, ...] = ()  # running sequences sent back to waiting (their KV is gone)
    dropped: tuple[Sequence, ...] = ()  # parked sequences aborted to free blocks (their handles are gone)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class _Lanes:
    queues: dict[Priority, deque[Sequence]] = field(default_factory=lambda: {p: deque() for p in Priority})

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __iter__(self) -> Iterator[Sequence]:
        return (s for p in Priority for s in self.queues[p])

    def next(self, step: int, aging_steps: int) -> Sequence | None:
        batch = self.queues[Priority.BATCH]
        if batch and step - batch[0].arrival >= aging_steps:
            return batch[0]
        return next(iter(self), None)

    def head(self, lane: Priority) -> Sequence | None:
        queue = self.queues[lane]
        return queue[0] if queue else None

    def remove(self, seq: Sequence) -> bool:
        queue = self.queues[seq.priority]
        try:
            queue.remove(seq)
        except ValueError:
            return False
        return True


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting = _Lanes()
        self.running: list[Sequence] = []
        self.parked: OrderedDict[int, Sequence] = OrderedDict()  # by seq_id, oldest first
        self._trimmed: list[Sequence] = []  # parked sequences aborted over `max_parked`, for the next output
        self.step_count = 0
        self._next_id = 0
        self.proposer = NGramProposer()  # drafts for speculative sequences (prompt lookup, no model)
        self.spec_proposed = 0  # draft tokens verified since start (a counter for tests and metrics)
        self.spec_accepted = 0  # of those, the ones kept
        self._batch_prompt_left: int | None = None  # this step's batch-lane prompt tokens left (None: no cap)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: EngineRequest, *, park_after_first: bool = False) -> Sequence:
        """Queue a request; raises `RequestTooLarge` if it could never fit."""
        total = len(request.prompt_ids) + max(request.max_tokens, len(request.completion_ids))
        if not request.prompt_ids or request.max_tokens <= len(request.completion_ids):
            raise RequestTooLarge(f"nothing to do: {len(request.prompt_ids)} prompt tokens, max_tokens={request.max_tokens}")
        if total > self.max_model_len or self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise RequestTooLarge(f"{total} tokens exceed the context ({self.max_model_len}) or the KV pool")
        seq = Sequence.from_request(request, seq_id=self._next_id, arrival=self.step_count)
        self._next_id += 1
        seq.park_after_first = park_after_first
        self.waiting.queues[seq.priority].append(seq)
        return seq

    def schedule(self, hold_batch: bool = False) -> SchedulerOutput:
        """Choose this step's chunks and allocate their blocks (see the module docstring for the policy).
        `hold_batch`: interactive work is about to arrive (a prefilled sequence's decode), so the batch
        lane sits this step out even when nothing else would run (the step may then be empty)."""
        self.step_count += 1
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        dropped, self._trimmed = self._trimmed, []  # aborted since the last step: their handles are gone too
        self.running.sort(key=lambda s: (s.priority, s.arrival, s.seq_id))
        scheduled: set[int] = set()
        interactive = self._interactive_present()
        self._batch_prompt_left = self._prompt_cap(interactive)
        yielding = hold_batch or self._batch_yields(interactive)
        for seq in list(self.running):
            if yielding and seq.priority is Priority.BATCH:
                continue
            budget = self._feed(seq, budget, chunks, scheduled, preempted, dropped)
        if not preempted:
            budget = self._admit(budget, chunks, scheduled, preempted, dropped, yielding, hold_batch)
        if yielding and not chunks and not hold_batch:  # nothing interactive could run after all: the batch lane does
            for seq in list(self.running):
                budget = self._feed(seq, budget, chunks, scheduled, preempted, dropped)
        budget = self._speculate(budget, chunks)  # drafts take only what the step's other work left
        decode_first = sorted(chunks, key=lambda c: len(c.token_ids) > 1)
        total = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(tuple(decode_first), total, tuple(preempted), tuple(dropped))

    def _batch_yields(self, interactive: bool) -> bool:
        """Whether this step leaves the batch lane out: an interactive sequence is running or waiting (its
        prefill then gets a step of its own) and the step is not one of every `batch_every`."""
        every = self.config.batch_every
        if every <= 1 or self.step_count % every == 0:
            return False
        return interactive

    def _prompt_cap(self, interactive: bool) -> int | None:
        """The batch lane's prompt tokens for this step (None: no cap): `batch_prompt_tokens`, or the
        smaller `shared_prompt_tokens` when interactive work may share the step."""
        caps = [c for c in (self.config.batch_prompt_tokens, self.config.shared_prompt_tokens if interactive else 0) if c]
        return min(caps, default=None)

    def _interactive_present(self) -> bool:
        return bool(self.waiting.queues[Priority.INTERACTIVE]) or any(s.priority is Priority.INTERACTIVE for s in self.running)

    def _prompt_allowance(self, seq: Sequence, n: int) -> int:
        """How many of `n` prompt tokens `seq` may be fed this step: all but for a batch-lane prefill
        (`batch_prompt_tokens` per step for the whole lane)."""
        if self._batch_prompt_left is None or seq.priority is not Priority.BATCH or n <= 1:
            return n
        n = min(n, self._batch_prompt_left)
        self._batch_prompt_left -= n
        return n

    def _feed(
        self, seq: Sequence, budget: int, chunks: list[ScheduledChunk], scheduled: set[int],
        preempted: list[Sequence], dropped: list[Sequence],
    ) -> int:
        """Schedules a running sequence's uncomputed tokens (up to `budget`), freeing blocks by dropping
        parked sequences, then preempting the lowest running ones, when they run out; returns the budget left."""
        if budget == 0 or seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled:
            return budget  # no budget, preempted earlier in this step, or already fed
        n = self._prompt_allowance(seq, min(seq.num_uncomputed_tokens, budget))
        if n == 0:
            return budget  # a batch prefill's share of this step is spent
        while not self.block_manager.can_allocate(seq, n):
            if self.parked:
                dropped.append(self._drop_oldest_parked())
                continue
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        if seq.status is SequenceStatus.RUNNING:
            chunks.append(self._chunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return budget

    def update_from_output(self, output: SchedulerOutput, sampled: list[StepTokens]) -> list[Sequence]:
        """Account for a finished step: advance computed tokens, register full blocks, append sampled
        tokens, finish or park sequences. `sampled[i]` belongs to `output.chunks[i]` (see `StepTokens`).
        A chunk with drafts appends its accepted tokens up to the first that ends the sequence and rolls
        back the KV of the rest. Sequences that left meanwhile (aborted) are skipped. Returns the
        sequences that got tokens (`seq.num_new_tokens` of them, at the end of `seq.token_ids`)."""
        progressed: list[Sequence] = []
        for chunk, tokens in zip(output.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != chunk.start:
                continue  # aborted, or preempted and re-admitted, while the step ran
            seq.num_computed_tokens += len(chunk.token_ids)
            if tokens is None:
                self.block_manager.commit(seq)
                continue
            accepted = (tokens,) if isinstance(tokens, int) else tokens
            seq.num_new_tokens = 0
            for token in accepted:
                seq.token_ids.append(token)
                seq.num_new_tokens += 1
                if seq.reached_stop():
                    break
            if chunk.num_drafts:
                self._count_drafts(seq, chunk.num_drafts, len(accepted) - 1)
                # the KV of the tokens fed past the last kept one (rejected or cut drafts) goes
                self.block_manager.truncate(seq, seq.num_computed_tokens - (len(seq.token_ids) - 1))
            self.block_manager.commit(seq)
            progressed.append(seq)
            if seq.reached_stop():
                self._finish(seq, SequenceStatus.FINISHED)
            elif seq.park_after_first:
                self._park(seq)
        return progressed

    def _count_drafts(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        if seq.draft_length is not None:
            seq.draft_length.observe(proposed, accepted)

    def abort(self, seq: Sequence) -> bool:
        """Stop `seq` wherever it is and free its blocks; False if it had already ended."""
        if seq.is_done:
            return False
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, SequenceStatus.ABORTED)
        return True

    def unpark(self, seq: Sequence) -> None:
        """Schedule a parked sequence again (its decode has begun)."""
        if self.parked.pop(seq.seq_id, None) is None:
            raise ValueError(f"sequence {seq.seq_id} is not parked")
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def adopt_parked(self, seq: Sequence) -> None:
        """Register an imported sequence (blocks already allocated and filled) as parked."""
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq
        self._trim_parked()

    def new_sequence(self, request: EngineRequest) -> Sequence:
        """A sequence with an id from this scheduler that is in no queue yet (for imports)."""
        seq = Sequence.from_request(request, seq_id=self._next_id, arrival=self.step_count)
        self._next_id += 1
        return seq

    def _speculate(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Extend the decode chunks of speculative sequences with drafts, while budget and free blocks
        allow (a sequence whose drafts do not fit decodes plainly); returns the budget left."""
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if budget <= 0:
                break
            if seq.draft_length is None or chunk.num_drafts or len(chunk.token_ids) != 1 or not chunk.sample:
                continue
            if seq.park_after_first:
                continue
            k = min(seq.draft_length.k, budget, seq.max_tokens - seq.num_completion_tokens - 1)
            drafts = self.proposer.propose(seq.token_ids, k)[:k] if k > 0 else []
            if not drafts or not self.block_manager.can_allocate(seq, 1 + len(drafts)):
                continue
            self.block_manager.allocate(seq, 1 + len(drafts))
            chunks[i] = replace(
                chunk, token_ids=(*chunk.token_ids, *drafts), block_table=tuple(seq.block_table), num_drafts=len(drafts)
            )
            budget -= len(drafts)
        return budget

    def _admit(self, budget: int, chunks: list[ScheduledChunk], scheduled: set[int], preempted: list[Sequence],
               dropped: list[Sequence], yielding: bool = False, hold_batch: bool = False) -> int:
        """Admits waiting sequences (see the module docstring). A batch request that cannot start this step
        (no seat, no blocks, the lane's prompt tokens spent), aged or not, ends the batch lane's admissions
        for the step, not the interactive lane's: an aged batch request at the head of the queue, such as a
        preempted one, must not hold back the interactive requests behind it."""
        interactive_only = False
        while budget > 0:
            seq = self.waiting.head(Priority.INTERACTIVE) if interactive_only else self.waiting.next(self.step_count, self.config.aging_steps)
            if seq is None:
                break
            n = self._admissible(seq, budget, scheduled, preempted, dropped, yielding, hold_batch)
            if n == 0:
                if seq.priority is Priority.BATCH and not interactive_only:
                    interactive_only = True
                    continue
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return budget

    def _admissible(self, seq: Sequence, budget: int, scheduled: set[int], preempted: list[Sequence],
                    dropped: list[Sequence], yielding: bool, hold_batch: bool = False) -> int:
        """How many of waiting `seq`'s prompt tokens can start this step (0: none), after freeing a seat
        and blocks for it where its lane may (parked sequences first, then batch-lane ones for an
        interactive request). While the batch lane is held for a due decode, no batch request starts,
        aged or not (the hold is short and bounded; an aged request's prompt chunk would make the step
        the decode then waits behind)."""
        if seq.priority is Priority.BATCH and hold_batch:
            return 0
        if len(self.running) >= self.config.max_num_seqs and not self._make_room(seq, scheduled, preempted, seat=True):
            return 0
        if yielding and seq.priority is Priority.BATCH:
            return 0  # its prefill waits for a step the batch lane runs in, aged or not
        n = min(len(seq.token_ids) - self.block_manager.cached_prefix_tokens(seq), budget)
        if seq.priority is Priority.BATCH and self._batch_prompt_left is not None:
            if self._batch_prompt_left < min(n, 2):
                return 0  # the batch lane's prompt tokens for this step are spent
            n = self._prompt_allowance(seq, n)
        while not self.block_manager.can_allocate(seq, n) and self.parked:
            dropped.append(self._drop_oldest_parked())
        while not self.block_manager.can_allocate(seq, n):
            if not self._make_room(seq, scheduled, preempted):
                return 0
        return n

    def _make_room(self, seq: Sequence, scheduled: set[int], preempted: list[Sequence], seat: bool = False) -> bool:
        """For an interactive `seq` that waits for blocks (or, `seat`, for a place in the batch): preempts
        the batch-lane sequence that arrived last among those not fed this step; False when there is
        none (a batch sequence, even an aged one, never preempts: it waits for blocks to free)."""
        if seq.priority is not Priority.INTERACTIVE:
            return False
        victim = next((s for s in reversed(self.running) if s.priority is Priority.BATCH and s.seq_id not in scheduled), None)
        if victim is None:
            return False
        self._preempt(victim)
        preempted.append(victim)
        return True

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        self.block_manager.allocate(seq, n)  # on first admission this also takes the prefix-cache hits
        start = seq.num_computed_tokens
        sample = start + n == len(seq.token_ids)
        return ScheduledChunk(
            seq=seq,
            start=start,
            token_ids=tuple(seq.token_ids[start : start + n]),
            block_table=tuple(seq.block_table),
            sample=sample,
            completion_index=len(seq.token_ids) - seq.num_prompt_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.waiting.queues[seq.priority].appendleft(seq)

    def _park(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.park_after_first = False
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq
        self._trim_parked()

    def _trim_parked(self) -> None:
        while len(self.parked) > self.config.max_parked:
            self._trimmed.append(self._drop_oldest_parked())  # reported like the ones dropped for blocks

    def _drop_oldest_parked(self) -> Sequence:
        _, seq = self.parked.popitem(last=False)
        self._finish(seq, SequenceStatus.ABORTED)
        return seq

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            self.parked.pop(seq.seq_id, None)
        self.block_manager.deallocate(seq)
        seq.status = status

"""The step loop: one asyncio task per backend advances every running sequence by one token per step.

    step = schedule() -> run the model in the model thread -> apply() -> drop finished sequences

`schedule` is bookkeeping only: it admits waiting sequences (new prompts, or prefilled sequences
arriving for decode) while fewer than `max_batch` run, with at most `prefill_budget` prompt tokens
of prefill per step (always at least one sequence), so a new prompt delays running streams by one
prefill at most. The model runs in one dedicated thread, so the event loop stays free during a step.
Sinks are called on the event loop; a sequence cancelled or released during a step has its token
discarded.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pipeline.backends.errors import BackendClosed, ModelError
from pipeline.backends.model_runner import ModelRunner, StepInput, StepOutput
from pipeline.backends.sequence import Sequence

__all__ = ["StepScheduler"]


class StepScheduler:
    def __init__(self, runner: ModelRunner, *, name: str, max_batch: int, prefill_budget: int = 512) -> None:
        if max_batch < 1 or prefill_budget < 1:
            raise ValueError(f"max_batch and prefill_budget must be at least 1, got {max_batch}, {prefill_budget}")
        self._runner = runner
        self._max_batch = max_batch
        self._prefill_budget = prefill_budget
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sluice-{name}-model")
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def active(self) -> int:
        """Sequences waiting or running."""
        return len(self._waiting) + len(self._running)

    def submit(self, sequence: Sequence) -> None:
        """Queue `sequence`; its sink hears of every token until it reports itself finished."""
        if self._closed:
            raise BackendClosed("backend is closed")
        self._ensure_task()
        self._waiting.append(sequence)
        self._wake.set()

    def release(self, sequence: Sequence) -> None:
        """Stop `sequence` silently (its consumer went away) and free its KV state."""
        self._remove(sequence)
        sequence.cache = None

    def cancel(self, request_id: str, error: Callable[[], BaseException]) -> int:
        """Stop every sequence of `request_id`, telling each sink `error()`; returns how many."""
        victims = [s for s in (*self._waiting, *self._running) if s.request_id == request_id]
        for sequence in victims:
            self.release(sequence)
            sequence.sink.on_error(error())
        return len(victims)

    async def aclose(self) -> None:
        """Stop the loop; every waiting or running sequence ends with `BackendClosed`."""
        self._closed = True
        task, self._task = self._task, None
        if self._loop is asyncio.get_running_loop():
            self._fail_all(lambda: BackendClosed("backend closed"))
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        else:  # the step loop ran on another event loop, which is gone along with its waiters
            self._waiting.clear()
            self._running.clear()
        self._executor.shutdown(wait=False)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences within the batch and prefill limits; return this step's batch."""
        budget = self._prefill_budget
        while self._waiting and len(self._running) < self._max_batch:
            cost = self._waiting[0].step_cost
            if cost > budget and budget < self._prefill_budget:
                break  # this step already admitted something; the long prompt goes next step
            budget -= cost
            self._running.append(self._waiting.popleft())
        return list(self._running)

    def apply(self, batch: list[Sequence], outputs: list[StepOutput]) -> None:
        """Hand each token to its sink; drop sequences that finished (or left during the step)."""
        for sequence, out in zip(batch, outputs, strict=True):
            if not any(s is sequence for s in self._running):
                continue  # cancelled or released while the step ran
            sequence.cache = out.cache
            sequence.pending_ids = [out.token_id]
            sequence.position += 1
            if sequence.sink.on_token(out.token_id):
                self._remove(sequence)

    def _ensure_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        if self._loop is not loop:  # a new event loop (the old one is gone, and its waiters with it)
            self._waiting.clear()
            self._running.clear()
            self._wake = asyncio.Event()
        self._loop = loop
        self._task = loop.create_task(self._run(), name="sluice-step-loop")
        self._task.add_done_callback(self._on_loop_exit)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self.schedule()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            inputs = [StepInput(tuple(s.pending_ids), s.cache, s.sampling, s.position) for s in batch]
            try:
                outputs = await loop.run_in_executor(self._executor, self._runner.step, inputs)
            except Exception as exc:  # the model failed: end this batch with a typed error, keep serving
                for sequence in batch:
                    if any(s is sequence for s in self._running):
                        self.release(sequence)
                        sequence.sink.on_error(_model_error(exc))
                continue
            self.apply(batch, outputs)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug in bookkeeping: fail every sequence rather than leave it hanging
            self._fail_all(lambda: _model_error(exc))

    def _fail_all(self, error: Callable[[], BaseException]) -> None:
        for sequence in [*self._waiting, *self._running]:
            self.release(sequence)
            sequence.sink.on_error(error())

    def _remove(self, sequence: Sequence) -> None:
        self._running = [s for s in self._running if s is not sequence]
        self._waiting = deque(s for s in self._waiting if s is not sequence)


def _model_error(cause: BaseException) -> ModelError:
    error = ModelError(f"model step failed: {cause!r}")
    error.__cause__ = cause
    return error

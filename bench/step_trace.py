"""What the engine's steps were while a benchmark ran: each step's start, duration and rows by lane,
recorded by wrapping `LLMEngine.execute` (the model part of a step) for the benchmark's process only.

    trace = StepTrace.install()
    ... run ...
    print(trace.summary(window_start, window_end, "probes during a backfill"))
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from pipeline.engine import llm_engine
from pipeline.engine.errors import StepInterrupted
from pipeline.engine.params import Priority
from pipeline.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class Step:
    start: float
    seconds: float
    gap: float  # since the previous step ended
    interactive_rows: int
    batch_rows: int
    stopped: bool = False  # a batch-only step stopped for an interactive arrival (its work is redone)
    batch_tokens: int = 0  # tokens the batch lane's rows fed (prompt chunks and decodes)


class StepTrace:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.arrivals: list[tuple[float, str]] = []  # (perf_counter, "prefill" | "decode") of interactive sequences
        self._last_end = 0.0

    @classmethod
    def install(cls) -> StepTrace:
        trace = cls()
        execute = llm_engine.LLMEngine.execute

        def traced(engine: llm_engine.LLMEngine, output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
            start, stopped = time.perf_counter(), False
            try:
                return execute(engine, output, interrupt)
            except StepInterrupted:
                stopped = True
                raise
            finally:
                trace.record(start, time.perf_counter(), output, stopped)

        llm_engine.LLMEngine.execute = traced  # type: ignore[method-assign]
        add, unpark = Scheduler.add, Scheduler.unpark

        def added(scheduler: Scheduler, request, **options):  # type: ignore[no-untyped-def]
            seq = add(scheduler, request, **options)
            if seq.priority is Priority.INTERACTIVE:
                trace.arrivals.append((time.perf_counter(), "prefill"))
            return seq

        def unparked(scheduler: Scheduler, seq) -> None:  # type: ignore[no-untyped-def]
            unpark(scheduler, seq)
            if seq.priority is Priority.INTERACTIVE:
                trace.arrivals.append((time.perf_counter(), "decode"))

        Scheduler.add, Scheduler.unpark = added, unparked  # type: ignore[method-assign]
        return trace

    def record(self, start: float, end: float, output: SchedulerOutput, stopped: bool = False) -> None:
        interactive = sum(1 for c in output.chunks if c.seq.priority is Priority.INTERACTIVE)
        batch_tokens = sum(len(c.token_ids) for c in output.chunks if c.seq.priority is Priority.BATCH)
        gap = start - self._last_end if self._last_end else 0.0
        self.steps.append(Step(start, end - start, gap, interactive, len(output.chunks) - interactive, stopped, batch_tokens))
        self._last_end = end

    def summary(self, start: float, end: float, label: str) -> str:
        """Mean duration and count of the steps between `start` and `end` (perf_counter), by kind."""
        steps = [s for s in self.steps if start <= s.start < end]
        kinds = {
            "interactive rows only": [s for s in steps if s.interactive_rows and not s.batch_rows],
            "interactive and batch rows": [s for s in steps if s.interactive_rows and s.batch_rows],
            "batch rows only": [s for s in steps if s.batch_rows and not s.interactive_rows and not s.stopped],
            "batch rows only, stopped for an interactive arrival": [s for s in steps if s.stopped],
        }
        lines = [f"  steps, {label}:"]
        for kind, found in kinds.items():
            if found:
                lines.append(f"    {kind}: {len(found)}, mean {1000 * statistics.fmean(s.seconds for s in found):.1f} ms "
                             f"(p50 {1000 * statistics.median(s.seconds for s in found):.1f}, "
                             f"max {1000 * max(s.seconds for s in found):.1f}), "
                             f"{statistics.fmean(s.interactive_rows + s.batch_rows for s in found):.1f} rows, "
                             f"gap before it {1000 * statistics.fmean(s.gap for s in found):.1f} ms")
        done = sum(s.batch_tokens for s in steps if not s.stopped)
        if done or any(s.stopped for s in steps):  # the batch lane's progress beside the probes, and what stops cost
            lines.append(f"    batch-lane tokens computed: {done / (end - start):.1f} per second ({done} in {end - start:.1f} s); "
                         f"stopped steps threw away {sum(s.seconds for s in steps if s.stopped):.1f} s")
        return "\n".join(lines)

    def within(self, start: float, end: float) -> str:
        """The steps that started between `start` and `end`, by kind: count and total ms (one request's story)."""
        steps = [s for s in self.steps if start <= s.start < end]
        running = [s for s in self.steps if s.start < start < s.start + s.seconds]  # the step it arrived during
        parts = [f"arrived {1000 * (running[0].start + running[0].seconds - start):.0f} ms before the end of a "
                 f"{'batch-only' if not running[0].interactive_rows else 'shared'} step"
                 f"{' (stopped then)' if running[0].stopped else ''}"] if running else []
        for kind, found in (("batch-only", [s for s in steps if not s.interactive_rows]),
                            ("interactive-only", [s for s in steps if s.interactive_rows and not s.batch_rows]),
                            ("shared", [s for s in steps if s.interactive_rows and s.batch_rows])):
            if found:
                parts.append(f"{len(found)} {kind} {1000 * sum(s.seconds for s in found):.0f} ms "
                             f"(max {1000 * max(s.seconds for s in found):.0f})")
        story = ", ".join(parts) or "no steps"
        events = sorted([(s.start, "batch-only step" if not s.interactive_rows else None) for s in steps]
                        + [(t, f"{kind} reached the engine") for t, kind in self.arrivals if start <= t < end])
        timeline = [f"+{1000 * (t - start):.0f} {what}" for t, what in events if what]
        return story + ("; " + ", ".join(timeline) if timeline else "")

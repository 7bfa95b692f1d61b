"""The worker processes of a chaos run and their supervisor.

N processes per stage (`python -m pipeline.cli worker STAGE`, this tree's code, logs in the state dir).
The harness is their supervisor, as `sluice run`'s will be: a worker it killed is started again after
~1 s; one that exits on its own is restarted too and recorded as a finding. Faults act by PID: SIGKILL,
SIGSTOP then SIGCONT, SIGTERM to scale in; a worker can be added under load.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.chaos.harness import PYTHON, ROOT
from tests.chaos.scenarios import WHOLE

RESTART_DELAY_S = 1.0  # as `sluice run`'s supervisor will


@dataclass
class WorkerRun:
    """One worker process's life, as the supervisor saw it."""

    pid: int
    stage: str
    started: float  # monotonic
    log: Path
    ended: float | None = None
    exit_code: int | None = None
    fate: str = "running"  # running | killed (SIGKILL by a fault) | removed (SIGTERM by the harness) | exited (on its own)

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "stage": self.stage, "fate": self.fate, "exit_code": self.exit_code, "log": str(self.log)}


@dataclass
class _Slot:
    run: WorkerRun
    process: subprocess.Popen[bytes]
    log_file: IO[bytes]
    intent: str | None = None  # what the harness did to it: killed | removed


@dataclass
class Supervisor:
    env: dict[str, str]
    logs: Path
    wanted: dict[str, int]  # stage -> processes to keep running
    rng: random.Random = field(default_factory=random.Random)
    runs: list[WorkerRun] = field(default_factory=list)
    _slots: list[_Slot] = field(default_factory=list)
    _monitor: asyncio.Task[None] | None = None
    _restarts: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for stage, count in self.wanted.items():
            for _ in range(count):
                self._spawn(stage)
        self._monitor = asyncio.create_task(self._watch())

    def live(self, stage: str) -> list[_Slot]:
        return [s for s in self._slots if s.run.stage == stage and s.intent is None]

    def live_pids(self) -> dict[str, set[int]]:
        """The live workers' pids by stage."""
        return {stage: {s.run.pid for s in self.live(stage)} for stage in self.wanted}

    def all_up(self) -> bool:
        return not self._restarts and all(len(self.live(stage)) >= n for stage, n in self.wanted.items())

    async def wait_all_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.all_up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not all running after {timeout_s} s")
            await asyncio.sleep(0.1)

    async def kill(self, stage: str) -> WorkerRun:
        """SIGKILL one random live worker of `stage`; the supervisor starts another after ~1 s."""
        slot = await self._pick(stage)
        slot.intent = "killed"
        slot.process.send_signal(signal.SIGKILL)
        return slot.run

    async def pause(self, stage: str, seconds: float) -> WorkerRun:
        """SIGSTOP one random live worker of `stage` for `seconds`, then SIGCONT."""
        slot = await self._pick(stage)
        slot.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            if slot.process.poll() is None:
                slot.process.send_signal(signal.SIGCONT)
        return slot.run

    def add(self, stage: str) -> WorkerRun:
        self.wanted[stage] += 1
        return self._spawn(stage).run

    async def remove(self, stage: str) -> WorkerRun:
        """SIGTERM one worker of `stage` (a graceful scale-in); it is not replaced."""
        slot = await self._pick(stage)
        self.wanted[stage] -= 1
        slot.intent = "removed"
        slot.process.send_signal(signal.SIGTERM)
        return slot.run

    async def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every worker (SIGCONT first, in case one is paused), KILL what is left after `timeout_s`."""
        for stage in self.wanted:
            self.wanted[stage] = 0
        for task in self._restarts:
            task.cancel()
        for slot in self._slots:
            if slot.process.poll() is None:
                slot.intent = slot.intent or "removed"
                slot.process.send_signal(signal.SIGCONT)
                slot.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(s.process.poll() is None for s in self._slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for slot in self._slots:
            if slot.process.poll() is None:
                slot.process.kill()
        self._reap()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)

    async def _pick(self, stage: str, timeout_s: float = 15.0) -> _Slot:
        """A random live worker of `stage`, waiting for a restart if none is up."""
        deadline = time.monotonic() + timeout_s
        while not (live := self.live(stage)):
            if time.monotonic() > deadline:
                raise LookupError(f"no live {stage} worker for {timeout_s} s")
            await asyncio.sleep(0.1)
        return self.rng.choice(live)

    def _spawn(self, stage: str) -> _Slot:
        index = sum(1 for r in self.runs if r.stage == stage)
        log = self.logs / f"{stage}-{index}.log"
        log_file = log.open("ab")
        process = subprocess.Popen(  # `worker` alone runs every stage of the profile (scenarios.WHOLE)
            [str(PYTHON), "-m", "pipeline.cli", "worker", *([] if stage == WHOLE else [stage])],
            cwd=ROOT, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        slot = _Slot(WorkerRun(process.pid, stage, time.monotonic(), log), process, log_file)
        self.runs.append(slot.run)
        self._slots.append(slot)
        return slot

    def _reap(self) -> list[_Slot]:
        """Record the end of every process that ended; returns those that ended now."""
        ended = []
        for slot in list(self._slots):
            code = slot.process.poll()
            if code is None:
                continue
            slot.run.ended, slot.run.exit_code = time.monotonic(), code
            slot.run.fate = slot.intent or "exited"
            slot.log_file.close()
            self._slots.remove(slot)
            ended.append(slot)
        return ended

    async def _watch(self) -> None:
        while True:
            for slot in self._reap():
                if len(self.live(slot.run.stage)) < self.wanted[slot.run.stage]:
                    task = asyncio.create_task(self._restart(slot.run.stage))
                    self._restarts.add(task)
                    task.add_done_callback(self._restarts.discard)
            await asyncio.sleep(0.1)

    async def _restart(self, stage: str) -> None:
        await asyncio.sleep(RESTART_DELAY_S)
        if len(self.live(stage)) < self.wanted[stage]:
            self._spawn(stage)

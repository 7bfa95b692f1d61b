"""`[batch]` in sluice.toml: where batch files live, their limits, and how fast a job feeds the pipeline.

Read once by `pipeline.settings.load()` and validated there (`problems()`)."""

from __future__ import annotations

from dataclasses import dataclass

DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class BatchSettings:
    enabled: bool = True  # the bridge serves /v1/files and /v1/batches and runs jobs
    dir: str = ".state/batch"  # input and output files (relative to the repository root); one machine's disk
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI's limit on a batch input file
    max_lines: int = 50_000  # OpenAI's limit on requests per batch
    # lines in the pipeline at once, per worker: below the engine's max_batch (16), so an interactive request
    # finds a free slot at once instead of waiting for a batch sequence to finish (docs/backfill.md)
    max_in_flight: int = 12
    admission_rps: float = 50.0  # lines started per second per worker (all its jobs); 0: as fast as max_in_flight allows
    line_deadline_s: float = 900.0  # each line's request deadline: batch work waits behind interactive work
    max_attempts: int = 4  # a line that fails with a retriable error (429, 503, 504...) is tried this often
    lease_s: float = 6.0  # a worker holds a job this long between renewals; a dead worker's job moves after it
    completion_window_s: float = DAY_S  # "24h", the only window OpenAI accepts
    keep_s: float = 30 * DAY_S  # a finished job's record stays this long, and its output and error files
    run_in_bridge: bool = True  # the bridge process also runs jobs (`sluice batch worker` runs them alone)
    # unfinished jobs one tenant may have: one more is refused with a 429 (each holds Redis memory for its
    # outcomes until it ends, and a place in the workers' queue)
    max_active_per_tenant: int = 10
    # jobs one worker drives at once (the lines of all of them share max_in_flight); the others wait, oldest
    # first, for a later scan or another worker
    max_jobs_per_worker: int = 4
    max_tenant_bytes: int = 10 * 1024**3  # a tenant's stored files (inputs and outputs); an upload past it is refused
    upload_keep_s: float = 30 * DAY_S  # uploads are deleted this long after upload (OpenAI's default); 0: kept until deleted

    def problems(self) -> list[str]:
        found = []
        for name in ("max_file_bytes", "max_lines", "max_in_flight", "max_attempts", "max_active_per_tenant",
                     "max_jobs_per_worker", "max_tenant_bytes"):
            if getattr(self, name) < 1:
                found.append(f"batch.{name} must be at least 1")
        for name in ("line_deadline_s", "lease_s", "completion_window_s", "keep_s"):
            if getattr(self, name) <= 0:
                found.append(f"batch.{name} must be positive")
        if self.admission_rps < 0:
            found.append("batch.admission_rps must not be negative (0: no rate limit)")
        if self.upload_keep_s and self.upload_keep_s < self.completion_window_s:  # a job made at once must find its file
            found.append("batch.upload_keep_s must be 0 (kept until deleted) or at least completion_window_s")
        if not self.dir:
            found.append("batch.dir must name a directory")
        return found

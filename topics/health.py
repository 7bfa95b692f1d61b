"""`llm.backend.health` (compacted, keyed by `<backend>/<worker>`): what each generation worker says of
its backend, once a second and at once when a failure streak reaches the ejection threshold. Every
route process reads the whole topic (it is small) and decides from the same records: load, health,
outlier ejection, latency objectives.
"""

from __future__ import annotations

import msgspec


class BackendHealth(msgspec.Struct, frozen=True, tag="backend_health.v1", tag_field="kind"):
    backend: str  # the backend's name in the config file
    pool: str
    worker: str  # the generation worker that reports (one backend may have several)
    at: float  # unix seconds of the report
    in_flight: int  # requests this worker is running on the backend now
    capacity: int  # how many it runs at once (max_batch); load = in_flight / capacity
    streak: int  # consecutive failures (retriable backend errors) since the last success
    ejections: int  # how many times the streak reached the threshold since the last success
    streak_at: float  # when the streak reached the threshold last (0: never)
    ttft_p95_ms: float  # time to first token over the last minute (0: no sample yet)
    error_rate: float  # failed / finished over the last minute

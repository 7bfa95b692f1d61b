"""`[observability]` in sluice.toml: where spans go, how many are kept, and where a worker serves /metrics.

    [observability]
    otlp_endpoint = "http://127.0.0.1:6006/v1/traces"   # OTLP over HTTP (Phoenix, Jaeger, a collector); "" keeps none
    sample_ratio = 1.0                                  # the share of new traces kept; stages follow the parent's choice
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObservabilitySettings:
    service_name: str = "sluice"  # the `service.name` resource attribute of every span
    otlp_endpoint: str = ""  # OTLP/HTTP traces endpoint (SLUICE_OTLP_ENDPOINT); empty: spans are made but not exported
    otlp_timeout_s: float = 10.0  # per export call
    export_process: bool = True  # encode and post spans in a child process (off the stages' GIL); false: in a thread here
    sample_ratio: float = 1.0  # traces started here that are recorded (parent-based: a stage follows its parent)
    recorder: str = "lean"  # "lean": sluice's span recorder (pipeline.observability.lean); "sdk": OpenTelemetry SDK's
    producer_spans: bool = False  # a PRODUCER span per produced message (OpenTelemetry's "send"); off: half the spans
    export_batch: int = 512  # spans per OTLP export call (BatchSpanProcessor)
    export_queue: int = 8192  # spans held for export; past it the newest are dropped, never waited for
    export_delay_ms: int = 1000  # how often the batch processor exports
    metrics_port: int = 0  # `sluice worker` processes serve /metrics on this port (0: none; the bridge serves its own)
    lag_interval_s: float = 5.0  # how often consumer lag is read from each stage's consumer
    # Tenants named in metric labels besides [gateway.tenants.*] and the anonymous tenant; any other is "other"
    tenant_labels: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        found = []
        if not 0.0 <= self.sample_ratio <= 1.0:
            found.append(f"observability.sample_ratio must be between 0 and 1, got {self.sample_ratio}")
        if self.recorder not in ("lean", "sdk"):
            found.append(f"observability.recorder must be \"lean\" or \"sdk\", got {self.recorder!r}")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            found.append("observability.otlp_endpoint must be an http:// or https:// URL (OTLP over HTTP)")
        if min(self.export_batch, self.export_queue, self.export_delay_ms) < 1 or self.export_batch > self.export_queue:
            found.append("observability.export_batch, export_queue and export_delay_ms must be positive, batch <= queue")
        if not 0 <= self.metrics_port < 65536:
            found.append(f"observability.metrics_port must be a port number, got {self.metrics_port}")
        if self.lag_interval_s <= 0 or self.otlp_timeout_s <= 0:
            found.append("observability.lag_interval_s and otlp_timeout_s must be positive")
        return found

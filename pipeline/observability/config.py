"""`[observability]` in sluice.toml: where spans go, how many are kept, and where a worker serves /metrics.

    [observability]
    otlp_endpoint = "http://127.0.0.1:6006/v1/traces"   # OTLP over HTTP (Phoenix, Jaeger, a collector); "" keeps none
    sample_ratio = 1.0                                  # the share of requests traced; stages follow ingest's choice
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ObservabilitySettings:
    service_name: str = "sluice"  # the `service.name` resource attribute of every span
    otlp_endpoint: str = ""  # OTLP/HTTP traces endpoint (SLUICE_OTLP_ENDPOINT); empty: spans are made but not exported
    otlp_timeout_s: float = 10.0  # per export call
    export_process: bool = True  # encode and post spans in a child process (off the stages' GIL); false: in a thread here
    sample_ratio: float = 1.0  # requests traced: drawn where a trace starts or enters (ingest); later stages follow it
    # Whether ingest follows the `sampled` flag and keeps the `tracestate` of a record on llm.requests, as
    # later stages do theirs. Off: it draws against sample_ratio itself and drops the tracestate, since any
    # producer allowed to write the topic (a tenant, in the secure profile) chose them. On only where sluice's
    # own clients alone write it (docs/operations.md, "Traces").
    trust_inbound_context: bool = False
    recorder: str = "lean"  # "lean": sluice's span recorder (pipeline.observability.lean); "sdk": OpenTelemetry SDK's
    producer_spans: bool = False  # a PRODUCER span per produced message (OpenTelemetry's "send"); off: half the spans
    export_batch: int = 512  # spans per OTLP export call (BatchSpanProcessor)
    export_queue: int = 8192  # spans held for export; past it the newest are dropped, never waited for
    export_delay_ms: int = 1000  # how often the batch processor exports
    metrics_port: int = 0  # `sluice worker` processes serve /metrics on this port (0: none; the bridge serves its own)
    # The address they bind: loopback unless bridge.metrics_token is set (they then require it, as the bridge's /metrics)
    metrics_host: str = "127.0.0.1"
    lag_interval_s: float = 5.0  # how often consumer lag is read from each stage's consumer
    # Tenants named in metric labels besides [gateway.tenants.*] and the anonymous tenant; any other is "other"
    tenant_labels: tuple[str, ...] = ()

    def problems(self, metrics_token: str = "") -> list[str]:
        """What cannot work, or would serve a worker's /metrics to anyone; `metrics_token`: bridge.metrics_token."""
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
        if self.metrics_port and not metrics_token and not loopback(self.metrics_host):
            found.append(f"observability.metrics_host {self.metrics_host!r} is not a loopback address: a worker's /metrics "
                         "there needs bridge.metrics_token (SLUICE_METRICS_TOKEN), which it then requires as the "
                         "bridge's /metrics does; or keep metrics_host = \"127.0.0.1\"")
        if self.lag_interval_s <= 0 or self.otlp_timeout_s <= 0:
            found.append("observability.lag_interval_s and otlp_timeout_s must be positive")
        return found


def loopback(host: str) -> bool:
    """Whether binding `host` listens on a loopback address only (a name other than localhost, or "": no)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an Authorization header's value is `Bearer <token>` (scheme in any case; constant-time):
    the check of /metrics, on the bridge's port and on a worker's."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

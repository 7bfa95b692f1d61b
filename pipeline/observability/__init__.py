"""Observability: where a request's time and money went.

    config.py     `[observability]` in sluice.toml: trace export and sampling, the worker metrics port
    watch.py      one request seen from its client (the SDK, hence the bridge): the root span, time to
                  first token, inter-token latency, end-to-end latency
    lag.py        consumer lag per stage and partition, from the runner's consumer
    engine.py     the engine's running and waiting sequences and KV-cache usage, read at scrape time
    costs.py      a request's cost from the configured prices; the tenant label, bounded
    usage_cli.py  `sluice usage --tenant T --since 1h`: spend and tokens from `llm.usage`
    dashboard/    `/dashboard`: a live page on the same metrics (uPlot, vendored from npm)

`pipeline/tracing.py` (W3C trace context in Kafka headers, the consumer and producer spans, the
exporter) and `pipeline/metrics.py` (every Prometheus metric) stay the two modules the runner imports.
"""

"""One request seen from its client (the SDK, and so the bridge and `sluice ask`): the trace's root span
and the latencies the client sees, named like vLLM's (time to first token, inter-token latency,
end-to-end latency).

The root span is started when the request is sent and ended at its terminal event (or when the caller
stops early). It is never made the current span: the SDK's stream is an async generator, and a context
attached in one step of a generator cannot be detached in another. Under the bridge the root is a child
of the HTTP request's SERVER span (`pipeline.observability.http`).
"""

from __future__ import annotations

import time
from collections.abc import Collection

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from pipeline import metrics, tracing
from pipeline.observability import recent
from pipeline.observability.costs import OTHER
from topics import registry
from topics.requests import Request
from topics.stream import Done, Failed


class RequestWatch:
    __slots__ = ("model", "span", "_sent", "_last", "chunks")

    def __init__(self, request: Request, models: Collection[str] = ()) -> None:
        """`models`: the configured ones. Any other name (the bridge passes on what the client sent, and
        ingest refuses it later) is labelled "other": a client could otherwise mint metric series and
        span names without end, one per made-up model, and the span would carry text of its choosing."""
        self.model = request.model if request.model in models else OTHER
        self.span = tracing.tracer.start_span(f"chat {self.model}", kind=trace.SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": self.model,  # as the metrics label it: no client-chosen name
            "gen_ai.request.max_tokens": request.sampling.max_tokens,
            "sluice.client.request_id": request.id,  # the client's random id; the pipeline's is <tenant>/<id>
            "sluice.request.messages": len(request.messages),
        })
        self._sent = self._last = 0.0
        self.chunks = 0

    def headers(self) -> list[tuple[str, bytes]]:
        """The PRODUCER span of the request's send to llm.requests, and the headers that carry the trace."""
        self._sent = self._last = time.perf_counter()
        return tracing.publish(registry.REQUESTS, trace.set_span_in_context(self.span), span=True)

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks == 0:
            metrics.TTFT.labels(self.model).observe(now - self._sent)
            self.span.add_event("first_chunk")
        else:
            metrics.ITL.labels(self.model).observe(now - self._last)
        self._last = now
        self.chunks += 1

    def finish(self, terminal: Done | Failed | None) -> None:
        """Ends the root span; `None`: the caller stopped early (cancelled), or no terminal event came."""
        if self._sent < 0:
            return  # already finished
        if terminal is not None and self._sent:
            metrics.E2E.labels(self.model).observe(time.perf_counter() - self._sent)
        span = self.span
        span.set_attribute("sluice.chunks", self.chunks)
        if terminal is not None:
            recent.REQUESTS.add(terminal)
            span.set_attribute("gen_ai.usage.input_tokens", terminal.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", terminal.usage.completion_tokens)
            span.set_attribute("sluice.cost", getattr(terminal, "cost", 0.0))
        if isinstance(terminal, Done):
            span.set_attribute("gen_ai.response.finish_reasons", (terminal.finish_reason.value,))
        elif isinstance(terminal, Failed):
            span.set_attribute("error.type", terminal.code.value)
            span.set_status(Status(StatusCode.ERROR, terminal.code.value))
        else:
            span.set_attribute("error.type", "cancelled")
        span.end()
        self._sent = -1.0

"""What the dashboard shows of single requests: the last finished requests as their client saw them
(outcome, tokens, cost, per-stage timings), and the spans of the last traces this process recorded, for
a waterfall of one request's stages. Bounded; process-wide like the Prometheus registry it sits beside."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from topics.stream import Done, Failed

MAX_TRACES = 8
MAX_SPANS = 4000  # per trace: a long answer is a few spans per chunk per stage


class RecentRequests:
    def __init__(self, size: int = 20) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, terminal: Done | Failed) -> None:
        self._items.append({
            "at": time.time(), "model": terminal.model,
            "outcome": terminal.finish_reason.value if isinstance(terminal, Done) else terminal.code.value,
            "prompt_tokens": terminal.usage.prompt_tokens, "completion_tokens": terminal.usage.completion_tokens,
            "cost": getattr(terminal, "cost", 0.0), "timings": dict(terminal.timings),
        })

    def items(self) -> list[dict[str, Any]]:
        return list(self._items)


class RecentTraces(SpanProcessor):
    """Keeps the CONSUMER spans (one per stage per message) and root spans of the last `MAX_TRACES` traces."""

    def __init__(self) -> None:
        self._traces: OrderedDict[int, list[tuple[str, int, int, bool]]] = OrderedDict()
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        root = span.parent is None
        if not root and span.kind is not trace.SpanKind.CONSUMER:
            return
        trace_id = span.context.trace_id
        with self._lock:
            spans = self._traces.get(trace_id)
            if spans is None:
                spans = self._traces[trace_id] = []
                while len(self._traces) > MAX_TRACES:
                    self._traces.popitem(last=False)
            if len(spans) < MAX_SPANS:
                spans.append((span.name, span.start_time or 0, span.end_time or 0, root))

    def waterfall(self) -> dict[str, Any] | None:
        """The last trace whose root has ended: each stage's first start and last end (ms after the root's
        start) and how many messages it handled, in the order the stages started."""
        with self._lock:
            traces = [list(spans) for spans in self._traces.values()]
        for spans in reversed(traces):
            roots = [s for s in spans if s[3]]
            if not roots or len(roots) == len(spans):
                continue  # not ended yet, or no stage took part
            name, start, end, _ = roots[0]
            stages: dict[str, list[float]] = {}
            for stage, s_start, s_end, root in sorted(spans, key=lambda s: s[1]):
                if root:
                    continue
                entry = stages.setdefault(stage, [(s_start - start) / 1e6, (s_end - start) / 1e6, 0])
                entry[0] = min(entry[0], (s_start - start) / 1e6)
                entry[1] = max(entry[1], (s_end - start) / 1e6)
                entry[2] += 1
            return {"root": name, "total_ms": (end - start) / 1e6,
                    "stages": [{"stage": k, "start_ms": v[0], "end_ms": v[1], "messages": int(v[2])} for k, v in stages.items()]}
        return None


REQUESTS = RecentRequests()
TRACES = RecentTraces()

"""CPU per stage span: what `tracing.consume_span` + `tracing.publish` + one attribute cost with the
OpenTelemetry SDK's spans, with sluice's lean recorder, and unsampled; and what OTLP encoding costs per
span with the SDK's encoder and with sluice's. Each recorder runs in a process of its own (a process
has one tracer provider), the modes interleaved, `--repeats` times; reported as median (min..max).

    .venv/bin/python -m bench.span_cost                  # 20,000 spans per run, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

from bench.stats import spread

MODES = ("sdk", "lean", "unsampled")


def measure(mode: str, spans: int) -> dict[str, float]:
    """In this process: µs of CPU per span recorded in `mode`, and per span encoded by each encoder."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pipeline import tracing
    from pipeline.observability.config import ObservabilitySettings
    from pipeline.observability.otlp import Encoder, flatten

    kept = InMemorySpanExporter()
    settings = ObservabilitySettings(recorder="sdk" if mode == "sdk" else "lean")
    tracing.install(settings, exporter=kept)  # batched, as served; kept in memory for the encoders
    flags = b"00" if mode == "unsampled" else b"01"
    record = SimpleNamespace(topic="llm.routed.upstream", partition=3, offset=12345, value=b"x" * 600, timestamp=0,
                             headers=[("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-" + flags)])
    started = time.process_time()
    for _ in range(spans):
        with tracing.consume_span(record, "route") as span:
            tracing.publish("llm.prefilled.upstream")
            span.set_attribute("outcome", "ok")
    out = {"record_us": (time.process_time() - started) / spans * 1e6}
    if mode == "unsampled":
        return out
    import opentelemetry.trace as trace

    trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
    finished = list(kept.get_finished_spans())[:5000]
    origins: dict = {}
    handoff = lambda b: pickle.dumps([flatten(s, origins) for s in b], protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
    encoder = Encoder()
    child = lambda b: encoder.encode_flat(pickle.loads(handoff(b)))  # noqa: E731
    for name, encode in (("sdk_encoder_us", lambda b: encode_spans(b).SerializePartialToString()), ("sluice_encoder_us", Encoder().encode),
                         ("handoff_us", handoff), ("child_us", child)):
        started = time.process_time()
        for i in range(0, len(finished), 512):
            encode(finished[i : i + 512])
        out[name] = (time.process_time() - started) / len(finished) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.spans)))
        return
    results: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for repeat in range(args.repeats):
        for mode in (MODES if repeat % 2 == 0 else tuple(reversed(MODES))):
            child = subprocess.run([sys.executable, "-m", "bench.span_cost", "--mode", mode, "--spans", str(args.spans)],
                                   check=True, capture_output=True, text=True)
            for key, value in json.loads(child.stdout.strip().splitlines()[-1]).items():
                results[mode].setdefault(key, []).append(value)

    print(f"\n{args.spans} spans per run, {args.repeats} runs per mode, µs of CPU per span: median (min..max)\n")
    print("| per stage span | SDK | sluice |\n| --- | --- | --- |")
    print(f"| recorded (sampled parent) | {spread(results['sdk']['record_us'])} | {spread(results['lean']['record_us'])} |")
    print(f"| not recorded (unsampled parent) | - | {spread(results['unsampled']['record_us'])} |")
    encoded = results["sdk"]["sdk_encoder_us"] + results["lean"]["sdk_encoder_us"]
    ours = results["sdk"]["sluice_encoder_us"] + results["lean"]["sluice_encoder_us"]
    print(f"| OTLP encoding, export thread | {spread(encoded)} | {spread(ours)} |")
    handoff = results["sdk"]["handoff_us"] + results["lean"]["handoff_us"]
    child = [c - h for c, h in zip(results["sdk"]["child_us"] + results["lean"]["child_us"], handoff, strict=True)]
    print(f"| handed to the export child instead (flatten + pickle, export thread) | - | {spread(handoff)} |")
    print(f"| in the export child (unpickle, encode) | - | {spread(child)} |")


if __name__ == "__main__":
    main()

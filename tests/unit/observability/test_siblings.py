"""One /metrics and /dashboard answer for every process that serves the bridge's shared port."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.observability.siblings import LABEL, Siblings, merged_metrics, merged_snapshot


def process_text(served: int, seconds: float) -> str:
    """A process's exposition: a counter and a histogram, as pipeline.metrics declares them."""
    registry = CollectorRegistry()
    Counter("sluice_messages_total", "Messages", ["stage"], registry=registry).labels("emit").inc(served)
    Histogram("sluice_e2e_seconds", "Latency", registry=registry, buckets=(0.1, 1.0)).observe(seconds)
    return generate_latest(registry).decode()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_each_process_s_samples_are_kept_apart_by_a_label_under_one_header_per_family() -> None:
    merged = merged_metrics({"0": process_text(3, 0.05), "1": process_text(5, 0.5)})
    got = samples(merged)
    assert got[("sluice_messages_total", (("sluice_process", "0"), ("stage", "emit")))] == 3
    assert got[("sluice_messages_total", (("sluice_process", "1"), ("stage", "emit")))] == 5
    assert got[("sluice_e2e_seconds_bucket", (("le", "0.1"), ("sluice_process", "1")))] == 0
    assert got[("sluice_e2e_seconds_bucket", (("le", "1.0"), ("sluice_process", "1")))] == 1
    text = merged.decode()
    assert text.count("# TYPE sluice_messages_total counter") == 1  # a second TYPE line is a scrape error
    assert text.count("# TYPE sluice_e2e_seconds histogram") == 1


def test_the_dashboard_snapshot_labels_samples_and_keeps_the_latest_requests_of_all() -> None:
    own = {"samples": {"sluice_messages_total": [[{"stage": "emit"}, 3.0]]}, "waterfall": None,
           "requests": [{"at": float(t), "model": "m"} for t in range(0, 30, 2)]}
    other = {"samples": {"sluice_messages_total": [[{"stage": "emit"}, 5.0]]}, "waterfall": {"root": "r"},
             "requests": [{"at": float(t), "model": "m"} for t in range(1, 30, 2)]}
    merged = merged_snapshot({"0": own, "1": other}, "0")
    assert merged["samples"]["sluice_messages_total"] == [[{"stage": "emit", LABEL: "0"}, 3.0], [{"stage": "emit", LABEL: "1"}, 5.0]]
    assert [r["at"] for r in merged["requests"]] == [float(t) for t in range(10, 30)]  # the last 20, oldest first
    assert merged["waterfall"] == {"root": "r"}  # this process has none yet: another's


@pytest.mark.asyncio
async def test_a_process_answers_for_itself_and_the_siblings_that_answer_on_their_sockets(tmp_path: Path) -> None:
    # large enough to arrive in many reads: an answer is read to its end, not to its first chunk
    snapshot: dict[str, Any] = {"samples": {f"sluice_x{i}": [[{"stage": "emit"}, float(i)]] for i in range(20000)},
                                "requests": [], "waterfall": None}
    first, second = Siblings(tmp_path, 0, lambda: snapshot), Siblings(tmp_path, 1, lambda: snapshot)
    await first.start()
    await second.start()
    (tmp_path / "7.sock").touch()  # a process gone without removing its socket: left out, no error
    try:
        gathered = await first.gather("metrics")
        assert sorted(gathered) == ["0", "1"]
        dashboard = json.loads((await second.gather("dashboard"))["0"])
        assert dashboard == snapshot
        labels = {s.labels.get(LABEL) for f in text_string_to_metric_families((await first.metrics()).decode()) for s in f.samples}
        assert labels == {"0", "1"}
    finally:
        await first.stop()
        await second.stop()

"""`runtime.gc_threshold`: once a process has started, what it loaded is frozen out of the collector's
walks and the youngest generation is collected less often; 0 keeps Python's defaults. Each case runs in a
process of its own (the settings change the whole interpreter's collector)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.settings import SettingsError, load

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import gc, json, sys
from dataclasses import replace
from pipeline import serve
from pipeline.settings import load
settings = load()
settings = replace(settings, runtime=replace(settings.runtime, gc_threshold=int(sys.argv[1])))
before = gc.get_threshold()
serve.settle_gc(settings)
serve.settle_gc(settings)  # a second call (a second group of stages in the process) changes nothing
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def _probe(threshold: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_started_process_freezes_what_it_loaded_and_collects_less_often() -> None:
    result = _probe(10000)
    assert result["after"] == [10000, *result["before"][1:]]  # type: ignore[index]
    assert isinstance(result["frozen"], int) and result["frozen"] > 1000  # modules and settings, at least


def test_zero_keeps_python_s_defaults() -> None:
    result = _probe(0)
    assert result["after"] == result["before"] and result["frozen"] == 0


def test_a_negative_threshold_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text((ROOT / "sluice.toml").read_text().replace("gc_threshold = 10000", "gc_threshold = -1"))
    with pytest.raises(SettingsError, match="gc_threshold"):
        load(config)

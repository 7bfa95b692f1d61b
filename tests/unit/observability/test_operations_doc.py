"""docs/operations.md lists every metric sluice exports (an operator reads the list, not the code)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DECLARED = re.compile(r'(?:Counter|Gauge|Histogram|MetricFamily)\(\s*"(sluice_[a-z0-9_]+)"')


def test_every_metric_is_in_the_operations_doc() -> None:
    sources = [ROOT / "pipeline" / "metrics.py", *sorted((ROOT / "pipeline" / "observability").glob("*.py"))]
    names = {m for path in sources for m in DECLARED.findall(path.read_text())}
    assert len(names) >= 25  # the pattern still finds the declarations
    doc = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in doc)  # a counter family may be listed with its _total
    assert missing == []

"""A guard builds without transformers and torch, which it never runs: pipeline.guard.presidio_lean
imports Presidio (and spaCy, thinc) without them and leaves both importable afterwards, and the context
limit reads the default model's directory name from the torch-free pipeline.checkpoints. In a fresh
interpreter: the test process has imported torch long before."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from pipeline.guard.context_limit import ContextLimit
from pipeline.guard.loader import InputGuard
from pipeline.settings import Settings
settings = Settings()
guard = InputGuard(settings.guard, settings.model_cache)
ContextLimit.from_settings(settings.backends, settings.model_cache)
loaded = {name: name in sys.modules for name in ("transformers", "torch")}
found = [f.entity for f in guard.pii.analyze(["Write to ada.lovelace@example.com, or call Ada Lovelace"])[0]]
import torch  # a later import works as usual (the detoxify toxicity backend's)
print(json.dumps({"loaded": loaded, "found": found, "torch_after": torch.__name__}))
"""


def test_a_guard_builds_without_transformers_or_torch() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loaded"] == {"transformers": False, "torch": False}
    assert "EMAIL" in result["found"] and "PERSON" in result["found"]  # spaCy's NER still runs
    assert result["torch_after"] == "torch"

"""Presidio, imported without the parts sluice never runs; the guard modules take its names from here.

`import presidio_analyzer` imports its Hugging Face NLP engine, whose module imports `transformers`'
pipelines (about 6 s of a guard process's 14 s start on 2 cores), and its device detector imports torch
and starts CUDA when a GPU is there. sluice runs Presidio's spaCy engine on the CPU only, so:

- `transformers` is hidden while Presidio is first imported (a `None` in `sys.modules` makes its
  `import` fail, which Presidio takes as "not installed"); the entry is removed right after, and any
  later `import transformers` works as usual. Where transformers is already loaded nothing is hidden.
- `PRESIDIO_DEVICE` defaults to `cpu` (an operator's own value is kept): no CUDA context in a guard.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PRESIDIO_DEVICE", "cpu")
_hide = "transformers" not in sys.modules
if _hide:
    sys.modules["transformers"] = None  # type: ignore[assignment]
try:
    from presidio_analyzer import (
        AnalyzerEngine,
        EntityRecognizer,
        LocalRecognizer,
        Pattern,
        PatternRecognizer,
        RecognizerRegistry,
        RecognizerResult,
    )
    from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngineProvider
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IbanRecognizer,
        IpRecognizer,
        PhoneRecognizer,
        SpacyRecognizer,
        UsSsnRecognizer,
    )
finally:
    if _hide and sys.modules.get("transformers", 0) is None:
        del sys.modules["transformers"]

__all__ = [
    "AnalyzerEngine", "CreditCardRecognizer", "EmailRecognizer", "EntityRecognizer", "IbanRecognizer", "IpRecognizer",
    "LocalRecognizer", "NlpArtifacts", "NlpEngineProvider", "Pattern", "PatternRecognizer", "PhoneRecognizer",
    "RecognizerRegistry", "RecognizerResult", "SpacyRecognizer", "UsSsnRecognizer",
]

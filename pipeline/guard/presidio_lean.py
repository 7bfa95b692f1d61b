"""Presidio and spaCy, imported without the parts sluice never runs; the guard modules take their names
from here, so that this module is where spaCy is first imported.

`import presidio_analyzer` imports its Hugging Face NLP engine, whose module imports `transformers`'
pipelines (about 6 s of a guard process's 14 s start on 2 cores), and its device detector imports torch
and starts CUDA when a GPU is there; spaCy imports thinc, which imports torch for its PyTorch layers
(about 2 s more). sluice runs Presidio's spaCy engine, with a model of thinc's own (numpy) layers, on the
CPU only, so:

- `transformers` and `torch` are hidden while Presidio and spaCy are first imported (a `None` in
  `sys.modules` makes their `import` fail, which Presidio and thinc take as "not installed"); the
  entries are removed right after, and any later `import torch` (the detoxify toxicity backend's)
  works as usual. Where one is already loaded it is not hidden. A spaCy model built on PyTorch layers
  (a transformer pipeline such as `en_core_web_trf`) would not load after this; sluice ships none.
- `PRESIDIO_DEVICE` defaults to `cpu` (an operator's own value is kept): no CUDA context in a guard.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PRESIDIO_DEVICE", "cpu")
_hidden = [name for name in ("transformers", "torch") if name not in sys.modules]
for _name in _hidden:
    sys.modules[_name] = None  # type: ignore[assignment]
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
    from spacy.lang.en.stop_words import STOP_WORDS
    from spacy.tokens import Doc, Token
finally:
    for _name in _hidden:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]

__all__ = [
    "STOP_WORDS", "AnalyzerEngine", "CreditCardRecognizer", "Doc", "EmailRecognizer", "EntityRecognizer",
    "IbanRecognizer", "IpRecognizer", "LocalRecognizer", "NlpArtifacts", "NlpEngineProvider", "Pattern",
    "PatternRecognizer", "PhoneRecognizer", "RecognizerRegistry", "RecognizerResult", "SpacyRecognizer", "Token",
    "UsSsnRecognizer",
]

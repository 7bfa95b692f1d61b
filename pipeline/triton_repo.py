"""Triton model repositories from sluice.toml.

    python -m pipeline.triton_repo tensorrt-llm --engine-dir DIR --tokenizer-dir DIR [--out triton_models]
        TensorRT-LLM's in-flight batching repository for a GPU host: `tensorrt_llm` (the engine,
        gpt_model_type inflight_fused_batching, paged KV with reuse, chunked context), `preprocessing`
        and `postprocessing` (the tokenizer, in Python) and `ensemble`, which chains them behind the
        tensor names sluice_llm also has, so `kind = "triton"` talks to either. Only the config.pbtxt
        files are written; the two Python models are checked in beside them.
    python -m pipeline.triton_repo run-config [--grpc-port 18001]
        sluice.toml with its [[backends]] replaced by infra/triton/backends.toml (`make run-triton`).

What comes from sluice.toml: the `[[backends]]` entry of kind "triton" whose `triton_model` is "ensemble"
gives the batch size (`max_batch`); without one, the defaults below apply. The GPU-side knobs are flags
(sluice's settings have no table for them; see docs/deploy.md). Configs are built as `model_config_pb2`
messages, so what is written parses against Triton's schema by construction; tests/unit/test_triton_repo.py
parses the checked-in files and checks the ensemble's wiring.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline import settings as settings_module

__all__ = ["TrtLlmOptions", "ensemble_config", "postprocessing_config", "preprocessing_config", "run_config",
           "tensorrt_llm_config", "write_tensorrt_llm_repository"]

ROOT = Path(__file__).resolve().parents[1]
_T = mc.DataType
_MODELS = ("tensorrt_llm", "preprocessing", "postprocessing", "ensemble")


@dataclass(frozen=True)
class TrtLlmOptions:
    engine_dir: str  # the built TensorRT-LLM engine (trtllm-build --output_dir), on the GPU host
    tokenizer_dir: str  # the Hugging Face tokenizer of the same model
    max_batch_size: int = 16  # Triton's batch and the engine's max_batch_size
    batch_scheduler_policy: str = "max_utilization"  # or guaranteed_no_evict
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True  # prefix reuse: the engine must be built with --use_paged_context_fmha
    enable_chunked_context: bool = True
    max_queue_delay_us: int = 0
    instance_count: int = 1  # preprocessing/postprocessing instances

    def __post_init__(self) -> None:
        if self.batch_scheduler_policy not in ("max_utilization", "guaranteed_no_evict"):
            raise ValueError("batch_scheduler_policy must be max_utilization or guaranteed_no_evict")
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ValueError("kv_cache_free_gpu_mem_fraction must be in (0, 1]")
        if self.max_batch_size < 1 or self.instance_count < 1 or self.max_queue_delay_us < 0:
            raise ValueError("max_batch_size and instance_count must be positive, max_queue_delay_us not negative")


def _tensor(kind: type, name: str, dtype: int, dims: Sequence[int], *, optional: bool = False,
            scalar: bool = False, ragged: bool = False) -> object:
    tensor = kind(name=name, data_type=dtype, dims=list(dims))
    if optional:
        tensor.optional = True
    if scalar:  # shaped [1] on the wire, [] inside the backend (TensorRT-LLM's convention)
        tensor.reshape.shape[:] = []
        tensor.reshape.SetInParent()
    if ragged:
        tensor.allow_ragged_batch = True
    return tensor


def _inputs(config: mc.ModelConfig, *specs: tuple) -> None:
    for name, dtype, dims, *flags in specs:
        config.input.append(_tensor(mc.ModelInput, name, dtype, dims, **dict.fromkeys(flags, True)))


def _outputs(config: mc.ModelConfig, *specs: tuple[str, int, list[int]]) -> None:
    for name, dtype, dims in specs:
        config.output.append(mc.ModelOutput(name=name, data_type=dtype, dims=dims))


def _parameters(config: mc.ModelConfig, values: dict[str, object]) -> None:
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = text


# The sampling knobs the ensemble passes straight to the engine: (ensemble name, engine name, type).
_SAMPLING = (
    ("top_k", "runtime_top_k", _T.TYPE_INT32),
    ("top_p", "runtime_top_p", _T.TYPE_FP32),
    ("temperature", "temperature", _T.TYPE_FP32),
    ("length_penalty", "len_penalty", _T.TYPE_FP32),
    ("repetition_penalty", "repetition_penalty", _T.TYPE_FP32),
    ("min_length", "min_length", _T.TYPE_INT32),
    ("presence_penalty", "presence_penalty", _T.TYPE_FP32),
    ("frequency_penalty", "frequency_penalty", _T.TYPE_FP32),
    ("random_seed", "random_seed", _T.TYPE_UINT64),
    ("beam_width", "beam_width", _T.TYPE_INT32),
)


def tensorrt_llm_config(options: TrtLlmOptions) -> mc.ModelConfig:
    config = mc.ModelConfig(name="tensorrt_llm", backend="tensorrtllm", max_batch_size=options.max_batch_size)
    config.model_transaction_policy.decoupled = True  # streaming: one response per generated token
    config.dynamic_batching.preferred_batch_size.append(options.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    _inputs(
        config,
        ("input_ids", _T.TYPE_INT32, [-1], "ragged"),
        ("input_lengths", _T.TYPE_INT32, [1], "scalar"),
        ("request_output_len", _T.TYPE_INT32, [1]),
        ("end_id", _T.TYPE_INT32, [1], "scalar", "optional"),
        ("pad_id", _T.TYPE_INT32, [1], "scalar", "optional"),
        ("stop_words_list", _T.TYPE_INT32, [2, -1], "optional", "ragged"),
        ("bad_words_list", _T.TYPE_INT32, [2, -1], "optional", "ragged"),
        *((engine, dtype, [1], "scalar", "optional") for _, engine, dtype in _SAMPLING),
        ("streaming", _T.TYPE_BOOL, [1], "optional"),
    )
    _outputs(
        config,
        ("output_ids", _T.TYPE_INT32, [-1, -1]),
        ("sequence_length", _T.TYPE_INT32, [-1]),
        ("cum_log_probs", _T.TYPE_FP32, [-1]),
        ("output_log_probs", _T.TYPE_FP32, [-1, -1]),
    )
    config.instance_group.append(mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU))
    _parameters(config, {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": options.engine_dir,
        "max_beam_width": 1,
        "batch_scheduler_policy": options.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": options.kv_cache_free_gpu_mem_fraction,
        "enable_kv_cache_reuse": options.enable_kv_cache_reuse,
        "enable_chunked_context": options.enable_chunked_context,
        "exclude_input_in_output": True,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    })
    return config


def _python_model(name: str, options: TrtLlmOptions) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=options.max_batch_size)
    config.instance_group.append(mc.ModelInstanceGroup(count=options.instance_count, kind=mc.ModelInstanceGroup.KIND_CPU))
    _parameters(config, {"tokenizer_dir": options.tokenizer_dir})
    return config


def preprocessing_config(options: TrtLlmOptions) -> mc.ModelConfig:
    config = _python_model("preprocessing", options)
    _inputs(
        config,
        ("QUERY", _T.TYPE_STRING, [1]),
        ("MESSAGES", _T.TYPE_STRING, [1], "optional"),  # sluice's extension: chat messages as JSON
        ("REQUEST_OUTPUT_LEN", _T.TYPE_INT32, [1]),
        ("STOP_WORDS_DICT", _T.TYPE_STRING, [-1], "optional"),
        ("BAD_WORDS_DICT", _T.TYPE_STRING, [-1], "optional"),
        ("END_ID", _T.TYPE_INT32, [1], "optional"),
        ("PAD_ID", _T.TYPE_INT32, [1], "optional"),
    )
    _outputs(
        config,
        ("INPUT_ID", _T.TYPE_INT32, [-1]),
        ("REQUEST_INPUT_LEN", _T.TYPE_INT32, [1]),
        ("REQUEST_OUTPUT_LEN", _T.TYPE_INT32, [1]),
        ("STOP_WORDS_IDS", _T.TYPE_INT32, [2, -1]),
        ("BAD_WORDS_IDS", _T.TYPE_INT32, [2, -1]),
        ("OUT_END_ID", _T.TYPE_INT32, [1]),
        ("OUT_PAD_ID", _T.TYPE_INT32, [1]),
    )
    return config


def postprocessing_config(options: TrtLlmOptions) -> mc.ModelConfig:
    config = _python_model("postprocessing", options)
    _inputs(config, ("TOKENS_BATCH", _T.TYPE_INT32, [-1, -1]), ("SEQUENCE_LENGTH", _T.TYPE_INT32, [-1]))
    _outputs(config, ("OUTPUT", _T.TYPE_STRING, [-1]))
    return config


def ensemble_config(options: TrtLlmOptions) -> mc.ModelConfig:
    """The client-facing model: sluice_llm's tensor names (text_input, max_tokens, stream, ...)."""
    config = mc.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=options.max_batch_size)
    _inputs(
        config,
        ("text_input", _T.TYPE_STRING, [1]),
        ("max_tokens", _T.TYPE_INT32, [1]),
        ("messages", _T.TYPE_STRING, [1], "optional"),
        ("stop_words", _T.TYPE_STRING, [-1], "optional"),
        ("bad_words", _T.TYPE_STRING, [-1], "optional"),
        ("end_id", _T.TYPE_INT32, [1], "optional"),
        ("pad_id", _T.TYPE_INT32, [1], "optional"),
        *((name, dtype, [1], "optional") for name, _, dtype in _SAMPLING),
        ("stream", _T.TYPE_BOOL, [1], "optional"),
    )
    _outputs(config, ("text_output", _T.TYPE_STRING, [-1]))
    steps = config.ensemble_scheduling.step
    steps.add(
        model_name="preprocessing", model_version=-1,
        input_map={"QUERY": "text_input", "MESSAGES": "messages", "REQUEST_OUTPUT_LEN": "max_tokens",
                   "STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words", "END_ID": "end_id",
                   "PAD_ID": "pad_id"},
        output_map={"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                    "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
                    "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID"},
    )
    steps.add(
        model_name="tensorrt_llm", model_version=-1,
        input_map={"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
                   "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_END_ID", "pad_id": "_PAD_ID",
                   "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS", "streaming": "stream",
                   **{engine: name for name, engine, _ in _SAMPLING}},
        output_map={"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"},
    )
    steps.add(
        model_name="postprocessing", model_version=-1,
        input_map={"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        output_map={"OUTPUT": "text_output"},
    )
    return config


def write_tensorrt_llm_repository(options: TrtLlmOptions, out: Path, command: str) -> list[Path]:
    """Write the four config.pbtxt files under `out` (and the engine model's empty version directory)."""
    builders = {"tensorrt_llm": tensorrt_llm_config, "preprocessing": preprocessing_config,
                "postprocessing": postprocessing_config, "ensemble": ensemble_config}
    written = []
    for name in _MODELS:
        path = out / name / "config.pbtxt"
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        header = f"# Generated by `{command}` (pipeline/triton_repo.py); edit sluice.toml or the flags, not this file.\n"
        path.write_text(header + text_format.MessageToString(builders[name](options)))
        written.append(path)
    for name in ("tensorrt_llm", "ensemble"):  # version directories with nothing in them (the engine lives
        (out / name / "1" / ".gitkeep").touch()  # in gpt_model_path), kept in git
    return written


def run_config(sluice_toml: str, backends_toml: str, grpc_port: int | None = None) -> str:
    """`sluice_toml` with every [[backends]] table replaced by `backends_toml` (text, comments kept)."""
    kept, skipping = [], False
    for line in sluice_toml.splitlines():
        header = re.match(r"\s*\[\[?([^\]]+)\]\]?", line)
        if header is not None:
            skipping = line.strip() == "[[backends]]"
        if not skipping:
            kept.append(line)
    if grpc_port is not None:
        backends_toml = re.sub(r'(url\s*=\s*"127\.0\.0\.1:)\d+"', rf'\g<1>{grpc_port}"', backends_toml)
    return "\n".join(kept).rstrip() + "\n\n" + backends_toml


def _options_from(args: argparse.Namespace) -> TrtLlmOptions:
    settings = settings_module.load(Path(args.config))
    ensembles = [b for b in settings.backends if b.kind == "triton" and b.triton_model == "ensemble"]
    return TrtLlmOptions(
        engine_dir=args.engine_dir, tokenizer_dir=args.tokenizer_dir,
        max_batch_size=ensembles[0].max_batch if ensembles else TrtLlmOptions.max_batch_size,
        batch_scheduler_policy=args.batch_scheduler_policy,
        kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
        enable_kv_cache_reuse=not args.no_kv_cache_reuse, enable_chunked_context=not args.no_chunked_context,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.triton_repo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trt = commands.add_parser("tensorrt-llm", help="write the TensorRT-LLM repository's config.pbtxt files")
    trt.add_argument("--config", default="sluice.toml")
    trt.add_argument("--engine-dir", required=True)
    trt.add_argument("--tokenizer-dir", required=True)
    trt.add_argument("--out", default=str(ROOT / "triton_models"))
    trt.add_argument("--batch-scheduler-policy", default="max_utilization")
    trt.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    trt.add_argument("--no-kv-cache-reuse", action="store_true")
    trt.add_argument("--no-chunked-context", action="store_true")
    run = commands.add_parser("run-config", help="print sluice.toml with the Triton backend of `make run-triton`")
    run.add_argument("--config", default="sluice.toml")
    run.add_argument("--backends", default=str(ROOT / "infra" / "triton" / "backends.toml"))
    run.add_argument("--grpc-port", type=int)
    args = parser.parse_args(argv)
    if args.command == "run-config":
        sys.stdout.write(run_config(Path(args.config).read_text(), Path(args.backends).read_text(), args.grpc_port))
        return
    command = " ".join(["python -m pipeline.triton_repo", *(sys.argv[1:] if argv is None else argv)])
    for path in write_tensorrt_llm_repository(_options_from(args), Path(args.out), command):
        print(path)


if __name__ == "__main__":
    main()

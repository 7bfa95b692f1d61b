"""The Triton model repositories checked against Triton's config schema (`model_config_pb2`), no server, no GPU."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline import settings as settings_module
from pipeline.triton_repo import TrtLlmOptions, main, run_config

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "triton_models"
TRT_MODELS = ("tensorrt_llm", "preprocessing", "postprocessing", "ensemble")
# What pipeline/backends/triton.py may send and read: the same name, type and shape on both models.
CLIENT_INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words", "messages")


def _config(name: str, repo: Path = REPO) -> mc.ModelConfig:
    # text_format.Parse refuses any field the schema does not have
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


@pytest.mark.parametrize("name", [*TRT_MODELS, "sluice_llm"])
def test_every_checked_in_config_parses_against_the_schema(name: str) -> None:
    config = _config(name)
    assert config.name == name
    assert (REPO / name / "1").is_dir()


def test_the_checked_in_tensorrt_llm_repository_is_what_the_command_in_its_header_generates(tmp_path: Path) -> None:
    header = (REPO / "ensemble" / "config.pbtxt").read_text().splitlines()[0]
    command = re.search(r"`python -m pipeline.triton_repo (.+?)`", header)
    assert command is not None, header
    main([*shlex.split(command.group(1)), "--out", str(tmp_path)])
    for name in TRT_MODELS:
        generated = (tmp_path / name / "config.pbtxt").read_text().splitlines()[1:]
        assert (REPO / name / "config.pbtxt").read_text().splitlines()[1:] == generated, name


def test_the_engine_runs_inflight_batching_with_kv_reuse_and_chunked_context() -> None:
    config = _config("tensorrt_llm")
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert config.backend == "tensorrtllm"
    assert config.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["batch_scheduler_policy"] in ("max_utilization", "guaranteed_no_evict")
    assert 0.0 < float(params["kv_cache_free_gpu_mem_fraction"]) <= 1.0
    assert params["enable_kv_cache_reuse"] == "true" and params["enable_chunked_context"] == "true"
    assert params["exclude_input_in_output"] == "true"


def _tensors(config: mc.ModelConfig) -> tuple[dict[str, mc.ModelInput], dict[str, mc.ModelOutput]]:
    return {t.name: t for t in config.input}, {t.name: t for t in config.output}


def test_the_ensemble_wires_every_step_to_tensors_that_exist_with_matching_types() -> None:
    ensemble = _config("ensemble")
    inputs, outputs = _tensors(ensemble)
    available = {name: t.data_type for name, t in inputs.items()}  # tensor name -> type, as the steps produce them
    optional = {name for name, t in inputs.items() if t.optional}
    for step in ensemble.ensemble_scheduling.step:
        model_inputs, model_outputs = _tensors(_config(step.model_name))
        for key, value in step.input_map.items():
            assert key in model_inputs, (step.model_name, key)
            assert value in available, (step.model_name, value)
            assert available[value] == model_inputs[key].data_type, (step.model_name, key)
            if value in optional:  # an optional ensemble input may only feed an optional model input
                assert model_inputs[key].optional, (step.model_name, key)
        required = {name for name, t in model_inputs.items() if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        for key, value in step.output_map.items():
            assert key in model_outputs, (step.model_name, key)
            available[value] = model_outputs[key].data_type
    for name, output in outputs.items():
        assert available.get(name) == output.data_type, name
    assert all(_config(m).max_batch_size == ensemble.max_batch_size for m in TRT_MODELS)


def test_a_client_cannot_tell_sluice_llm_from_the_ensemble() -> None:
    sluice_inputs, sluice_outputs = _tensors(_config("sluice_llm"))
    trt_inputs, trt_outputs = _tensors(_config("ensemble"))
    for name in CLIENT_INPUTS:
        a, b = sluice_inputs[name], trt_inputs[name]
        assert (a.data_type, list(a.dims), a.optional) == (b.data_type, list(b.dims), b.optional), name
    assert sluice_outputs["text_output"].data_type == trt_outputs["text_output"].data_type
    assert list(sluice_outputs["text_output"].dims) == list(trt_outputs["text_output"].dims)
    assert _config("sluice_llm").max_batch_size > 0 and _config("ensemble").max_batch_size > 0  # both [1, n]
    assert _config("sluice_llm").model_transaction_policy.decoupled


def test_the_batch_size_comes_from_the_ensemble_backend_in_sluice_toml(tmp_path: Path) -> None:
    toml = (ROOT / "sluice.toml").read_text() + (
        '\n[[backends]]\nname = "gpu"\nkind = "triton"\nmodel = "smollm2-135m-instruct"\npool = "gpu"\n'
        'url = "10.0.0.5:8001"\ntriton_model = "ensemble"\nmax_batch = 48\n'
    )
    (tmp_path / "sluice.toml").write_text(toml)
    out = tmp_path / "repo"
    main(["tensorrt-llm", "--config", str(tmp_path / "sluice.toml"), "--engine-dir", "/e", "--tokenizer-dir", "/t",
          "--out", str(out), "--batch-scheduler-policy", "guaranteed_no_evict"])
    assert {_config(m, out).max_batch_size for m in TRT_MODELS} == {48}
    assert _config("tensorrt_llm", out).parameters["batch_scheduler_policy"].string_value == "guaranteed_no_evict"


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="batch_scheduler_policy"):
        TrtLlmOptions(engine_dir="/e", tokenizer_dir="/t", batch_scheduler_policy="fifo")
    with pytest.raises(ValueError, match="kv_cache_free_gpu_mem_fraction"):
        TrtLlmOptions(engine_dir="/e", tokenizer_dir="/t", kv_cache_free_gpu_mem_fraction=1.5)


def test_the_run_triton_config_is_sluice_toml_with_the_triton_backend_only(tmp_path: Path) -> None:
    text = run_config((ROOT / "sluice.toml").read_text(), (ROOT / "infra/triton/backends.toml").read_text(), 18555)
    (tmp_path / "sluice.toml").write_text(text)
    triton = settings_module.load(tmp_path / "sluice.toml", env={})
    default = settings_module.load(ROOT / "sluice.toml", env={})
    (backend,) = triton.backends
    assert (backend.kind, backend.url, backend.triton_model, backend.splits) == ("triton", "127.0.0.1:18555", "sluice_llm", False)
    assert {b.model for b in default.backends} >= {backend.model}
    assert replace(triton, backends=default.backends) == default

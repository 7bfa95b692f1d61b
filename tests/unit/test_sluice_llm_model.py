"""triton_models/sluice_llm/1/model.py without Triton: a stand-in for `triton_python_backend_utils` and a
stand-in engine, so its queue bound can be watched (the real server: tests/integration/test_triton.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.backends.base import Delta, GenerationRequest
from pipeline.backends.errors import InvalidRequest, Overloaded
from pipeline.backends.local import MAX_BYTES_PER_TOKEN, LocalBackend
from pipeline.backends.triton import _mapped

MODEL = Path(__file__).resolve().parents[2] / "triton_models" / "sluice_llm"
FINAL = 1


class _TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self._message, self.code = message, code

    def message(self) -> str:
        return self._message


def _pb_utils() -> ModuleType:
    """What the model uses of `triton_python_backend_utils`."""
    pb = ModuleType("triton_python_backend_utils")
    pb.TritonError = _TritonError  # type: ignore[attr-defined]
    pb.TritonModelException = RuntimeError  # type: ignore[attr-defined]
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    pb.Tensor = lambda name, array: (name, array)  # type: ignore[attr-defined]
    pb.InferenceResponse = lambda output_tensors=(), error=None: SimpleNamespace(outputs=dict(output_tensors), error=error)  # type: ignore[attr-defined]
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)  # type: ignore[attr-defined]
    pb.Logger = SimpleNamespace(log_info=lambda message: None, log_error=lambda message: None)  # type: ignore[attr-defined]
    return pb


class _Request:
    """A Triton request of one prompt, with the responses its sender was given."""

    def __init__(self, prompt: str) -> None:
        self.inputs = {
            "text_input": SimpleNamespace(as_numpy=lambda: np.array([[prompt.encode()]], dtype=np.object_)),
            "max_tokens": SimpleNamespace(as_numpy=lambda: np.array([[4]], dtype=np.int32)),
        }
        self.sent: list[tuple[Any, int]] = []

    def get_response_sender(self) -> Any:
        return SimpleNamespace(send=lambda response=None, flags=0: self.sent.append((response, flags)))

    def is_cancelled(self) -> bool:
        return False

    def request_id(self) -> str:
        return "client-id"


class _Backend:
    """The engine as the model sees it: each generation waits for `release`, then ends with one token;
    its input bound is LocalBackend's, for a context of 4 tokens (64 bytes)."""

    _context_length = 4
    max_input_bytes = MAX_BYTES_PER_TOKEN * _context_length
    check_input_size = LocalBackend.check_input_size

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.release = asyncio.Event()
        self.engine = SimpleNamespace(next_step=lambda: asyncio.sleep(0.01))

    @classmethod
    def from_path(cls, *args: object, **kwargs: object) -> _Backend:
        return cls()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        await self.release.wait()
        yield Delta("ok", (1,), "stop")

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return 1

    async def cancel(self, request_id: str) -> None:
        pass


def _config(**parameters: str) -> dict[str, Any]:
    """The checked-in config.pbtxt as Triton hands it to `initialize` (JSON), `parameters` overriding."""
    config = text_format.Parse((MODEL / "config.pbtxt").read_text(), mc.ModelConfig())
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@pytest.fixture
def model_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    spec = importlib.util.spec_from_file_location("sluice_llm_model", MODEL / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LocalBackend", _Backend)
    monkeypatch.setattr(module, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: None))
    monkeypatch.setattr(module.torch, "set_num_threads", lambda n: None)
    return module


def _model(module: ModuleType, tmp_path: Path, **parameters: str) -> Any:
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(_config(model_dir=str(tmp_path), **parameters))})
    return model


def test_the_checked_in_config_bounds_the_queue() -> None:
    params = {key: value["string_value"] for key, value in _config()["parameters"].items()}
    assert int(params["max_queue_size"]) >= int(params["max_batch"])


@pytest.mark.asyncio
async def test_a_request_beyond_max_batch_plus_max_queue_size_is_refused_at_once_as_overloaded(
    model_module: ModuleType, tmp_path: Path
) -> None:
    model = _model(model_module, tmp_path, max_batch="2", max_queue_size="1")
    held = [_Request(f"p{i}") for i in range(3)]
    serving = asyncio.ensure_future(model.execute(held))
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(model._live) == 3 and not any(r.sent for r in held)

    extra = _Request("one too many")
    await asyncio.wait_for(model.execute([extra]), 1.0)  # answered at once, not queued behind the three
    ((response, flags),) = extra.sent
    assert flags == FINAL and response.error.code == _TritonError.UNAVAILABLE
    assert response.error.message().startswith("sluice.Overloaded: ")
    assert "max_batch 2 + max_queue_size 1" in response.error.message()
    error = _mapped(response.error.message())  # what pipeline/backends/triton.py makes of it
    assert isinstance(error, Overloaded) and error.retriable

    model._backend.release.set()
    await asyncio.wait_for(serving, 1.0)
    assert all(r.sent[-1][0].outputs["text_output"][0][0] == b"ok" for r in held)
    again = _Request("room again")
    await asyncio.wait_for(model.execute([again]), 1.0)
    assert again.sent[-1][0].error is None and again.sent[-1][1] == FINAL
    if model._watcher is not None:
        await asyncio.wait_for(model._watcher, 1.0)


def test_a_negative_queue_size_is_refused_at_load(model_module: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="max_queue_size"):
        _model(model_module, tmp_path, max_queue_size="-1")


@pytest.mark.asyncio
async def test_resume_text_too_large_for_the_context_is_refused_before_it_is_tokenised(
    model_module: ModuleType, tmp_path: Path
) -> None:
    """The model tokenises resume_text itself, on Triton's event loop: a text over the backend's bound is
    an InvalidRequest before that, not seconds of every stream and cancellation held up."""
    model = _model(model_module, tmp_path)
    uses: list[str] = []
    model._tokenizer = lambda *args, **kwargs: uses.append("tokenised") or {"input_ids": [1]}
    request = _Request("hi")
    request.inputs["resume_text"] = SimpleNamespace(as_numpy=lambda: np.array([[b"x" * 65]], dtype=np.object_))
    await asyncio.wait_for(model.execute([request]), 1.0)
    ((response, flags),) = request.sent
    assert flags == FINAL and response.error.code == _TritonError.INVALID_ARG
    assert response.error.message().startswith("sluice.InvalidRequest: resume_text is 65 bytes")
    assert isinstance(_mapped(response.error.message()), InvalidRequest) and not uses

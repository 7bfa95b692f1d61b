"""The triton backend's request building and error mapping, without a server (the real server:
tests/integration/test_triton.py)."""

from __future__ import annotations

import pytest

from pipeline.backends.base import GenerationRequest, Message
from pipeline.backends.errors import BackendClosed, Cancelled, InvalidRequest, ModelError
from pipeline.backends.triton import TritonBackend, _inputs, _mapped, _ModelSchema

SLUICE_LLM = _ModelSchema(
    inputs=frozenset({"text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words",
                      "messages", "resume_text", "tenant"}),
    outputs=("text_output", "finish_reason", "prompt_tokens", "completion_tokens"),
    batched=True,
)
ENSEMBLE = _ModelSchema(
    inputs=frozenset({"text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words",
                      "bad_words", "top_k"}),
    outputs=("text_output",),
    batched=True,
)


def _by_name(request: GenerationRequest, schema: _ModelSchema) -> dict[str, tuple[list[int], str, object]]:
    return {i.name(): (i.shape(), i.datatype(), i) for i in _inputs(request, schema)}


def test_inputs_follow_the_ensemble_shapes_and_only_what_the_model_declares() -> None:
    request = GenerationRequest("r", prompt="Hi", max_tokens=7, temperature=0.5, seed=3, stop=("\n", "END"))
    inputs = _by_name(request, ENSEMBLE)
    assert set(inputs) == {"text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words"}
    assert inputs["text_input"][:2] == ([1, 1], "BYTES")
    assert inputs["max_tokens"][:2] == ([1, 1], "INT32")
    assert inputs["random_seed"][:2] == ([1, 1], "UINT64")
    assert inputs["stop_words"][:2] == ([1, 2], "BYTES")
    unbatched = _ModelSchema(ENSEMBLE.inputs, ENSEMBLE.outputs, batched=False)
    assert _by_name(request, unbatched)["text_input"][0] == [1]


def test_chat_and_resume_go_only_to_a_model_that_takes_them() -> None:
    chat = GenerationRequest("r", messages=(Message("user", "Hi"),), resume_text="Hel")
    assert {"messages", "resume_text", "tenant"} <= set(_by_name(chat, SLUICE_LLM))
    with pytest.raises(InvalidRequest, match="prompt only"):
        _inputs(chat, ENSEMBLE)
    with pytest.raises(InvalidRequest, match="resume_text"):
        _inputs(GenerationRequest("r", prompt="Hi", resume_text="Hel"), ENSEMBLE)
    with pytest.raises(InvalidRequest, match="exactly one"):
        _inputs(GenerationRequest("r"), SLUICE_LLM)


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("sluice.InvalidRequest: prompt (10) + max_tokens (5000) exceeds the context", InvalidRequest),
        ("sluice.ModelError: model step failed: RuntimeError('nan')", ModelError),
        ("sluice.BackendClosed: the engine is closed", BackendClosed),
        ("sluice.Cancelled: request r cancelled", Cancelled),
        ("[request id: r] unexpected inference input 'bad_words' for model 'sluice_llm'", InvalidRequest),
        ("[request id: r] inference input 'max_tokens' data-type is 'FP32', but model 'x' expects 'INT32'", InvalidRequest),
        ("Request for unknown model: 'nope' is not found", ModelError),
        ("Executor failed: out of memory", ModelError),
    ],
)
def test_stream_errors_map_to_the_backend_error_with_their_policy(message: str, kind: type) -> None:
    error = _mapped(message)
    assert type(error) is kind
    assert "sluice." not in str(error)


def test_the_address_must_be_a_grpc_host_and_port() -> None:
    with pytest.raises(ValueError, match="host:port"):
        TritonBackend("http://127.0.0.1:8001", "sluice_llm")
    assert not TritonBackend("127.0.0.1:8001", "sluice_llm").resumes  # unknown until the model's config is read


class _Closing:
    """A gRPC stream the server closes without one response (cancel: a no-op)."""

    def __aiter__(self) -> "_Closing":
        return self

    async def __anext__(self) -> object:
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


def _backend_with(schema: _ModelSchema, call: object, on_schema: object = None) -> TritonBackend:
    backend = TritonBackend("127.0.0.1:1", "ensemble")

    async def model_schema() -> _ModelSchema:
        if on_schema is not None:
            await on_schema(backend)  # type: ignore[operator]
        return schema

    class Client:
        def stream_infer(self, inputs: object) -> object:
            return call

    backend._model_schema = model_schema  # type: ignore[method-assign]
    backend._connected = lambda: Client()  # type: ignore[method-assign,assignment,return-value]
    return backend


@pytest.mark.asyncio
async def test_a_stream_closed_without_a_response_is_no_answer_and_a_cancel_while_the_config_is_read_counts() -> None:
    schema = ENSEMBLE
    request = GenerationRequest(request_id="r1", prompt="hi", max_tokens=4)
    with pytest.raises(ModelError):  # it ended as an empty answer with finish "stop"
        [d async for d in _backend_with(schema, _Closing()).generate(request)]

    async def cancel_meanwhile(backend: TritonBackend) -> None:
        await backend.cancel("r1")

    with pytest.raises(Cancelled):  # the cancel found no call yet and was lost; the stream then ran to its end
        [d async for d in _backend_with(schema, _Closing(), cancel_meanwhile).generate(request)]


def test_a_greedy_request_asks_tensorrt_llm_for_top_k_1() -> None:
    greedy = _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4), ENSEMBLE)
    assert greedy["top_k"][:2] == ([1, 1], "INT32")  # temperature 0 with top_p 1 samples there
    assert "top_k" not in _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4, temperature=0.7), ENSEMBLE)
    assert "top_k" not in _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4), SLUICE_LLM)  # no such input

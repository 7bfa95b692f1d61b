"""The triton backend's request building, error mapping and stop-string cutting, without a server (the
real server: tests/integration/test_triton.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.backends.base import Delta, GenerationRequest, Message
from pipeline.backends.errors import BackendClosed, Cancelled, InvalidRequest, ModelError, Overloaded
from pipeline.backends.triton import TritonBackend, _inputs, _mapped, _ModelSchema
from pipeline.triton_repo import TrtLlmOptions, ensemble_config, tensorrt_llm_config
from topics.errors import ErrorCode

OPTIONS = TrtLlmOptions(engine_dir="/engines/e", tokenizer_dir="/models/t")
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
        # the deployed model is not what its config said: the backend's fault, retriable elsewhere, not the client's
        ("[request id: r] unexpected inference input 'bad_words' for model 'sluice_llm'", ModelError),
        ("[request id: r] inference input 'max_tokens' data-type is 'FP32', but model 'x' expects 'INT32'", ModelError),
        ("[request id: r] expected 1 inputs but got 0 inputs for model 'x'. missing required input 'y'", ModelError),
        ("Request for unknown model: 'nope' is not found", ModelError),
        ("Executor failed: out of memory", ModelError),
        ("sluice.Overloaded: sluice_llm holds 288 requests (max_batch 32 + max_queue_size 256); retry", Overloaded),
        ("[request id: r] Exceeds maximum queue size", Overloaded),
    ],
)
def test_stream_errors_map_to_the_backend_error_with_their_policy(message: str, kind: type) -> None:
    error = _mapped(message)
    assert type(error) is kind
    assert "sluice." not in str(error)


def test_a_full_queue_is_retriable_elsewhere() -> None:
    error = _mapped("sluice.Overloaded: sluice_llm holds 288 requests (max_batch 32 + max_queue_size 256); retry")
    assert error.retriable and error.code is ErrorCode.rate_limited  # the generation stage tries the next backend


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


class _Paced:
    """A gRPC stream whose responses come when the test says (`respond`), ten in all."""

    def __init__(self) -> None:
        self.waiting: asyncio.Future[tuple[_Result, None]] | None = None
        self.sent = 0

    def __aiter__(self) -> "_Paced":
        return self

    def __anext__(self) -> asyncio.Future[tuple[_Result, None]]:
        self.waiting = asyncio.get_running_loop().create_future()
        return self.waiting

    def respond(self) -> None:
        assert self.waiting is not None and not self.waiting.done()
        self.sent += 1
        if self.sent > 10:
            self.waiting.set_exception(StopAsyncIteration())
        else:
            self.waiting.set_result((_Result(f"t{self.sent}"), None))

    def cancel(self) -> None:
        pass


@pytest.mark.asyncio
async def test_a_task_cancelled_as_a_response_comes_in_ends_at_once() -> None:
    """A revoke's cancel that lands in the loop turn a response completes is not swallowed (3.11's
    `asyncio.wait_for` returned the response and the task read the stream to its end)."""
    call = _Paced()
    backend = _backend_with(ENSEMBLE, call)
    request = GenerationRequest(request_id="r1", prompt="hi", max_tokens=16)
    read: list[Delta] = []

    async def decode() -> None:
        async for delta in backend.generate(request):
            read.append(delta)

    task = asyncio.create_task(decode())
    for _ in range(3):
        await asyncio.sleep(0.01)
        call.respond()
    task.cancel()  # the revoke, in the turn the third response came in
    for _ in range(7):  # the server goes on answering
        await asyncio.sleep(0.01)
        if call.waiting is not None and not call.waiting.done():
            call.respond()
    assert task.done(), f"the cancelled task read {call.sent - 3} more responses"
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(read) <= 3


def test_a_greedy_request_asks_tensorrt_llm_for_top_k_1() -> None:
    greedy = _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4), ENSEMBLE)
    assert greedy["top_k"][:2] == ([1, 1], "INT32")  # temperature 0 with top_p 1 samples there
    assert "top_k" not in _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4, temperature=0.7), ENSEMBLE)
    assert "top_k" not in _by_name(GenerationRequest("r", prompt="Hi", max_tokens=4), SLUICE_LLM)  # no such input


class _Result:
    """One streamed response: its text, and what only some models send (sluice_llm's ending and counts)
    or Triton flags (the final response of a decoupled model's request)."""

    def __init__(self, text: str | bytes | None, *, final: bool = False, finish: str | None = None,
                 counts: tuple[int, int] | None = None) -> None:
        self.text, self.final, self.finish, self.counts = text, final, finish, counts

    def as_numpy(self, name: str) -> np.ndarray | None:
        if name == "text_output" and self.text is not None:
            raw = self.text.encode() if isinstance(self.text, str) else self.text
            return np.array([[raw]], dtype=np.object_)
        if name == "finish_reason" and self.finish is not None:
            return np.array([[self.finish.encode()]], dtype=np.object_)
        if name in ("prompt_tokens", "completion_tokens") and self.counts is not None:
            return np.array([[self.counts[name == "completion_tokens"]]], dtype=np.int32)
        return None

    def get_response(self) -> SimpleNamespace:
        return SimpleNamespace(parameters={"triton_final_response": SimpleNamespace(bool_param=self.final)})


class _Stream:
    """A gRPC stream that answers with `results` and remembers whether it was cancelled (and how many
    responses were read before that)."""

    def __init__(self, results: list[_Result]) -> None:
        self._results = iter(results)
        self.read = 0
        self.cancelled = False

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> tuple[_Result, None]:
        if self.cancelled:
            raise AssertionError("read after cancel")
        result = next(self._results, None)
        if result is None:
            raise StopAsyncIteration
        self.read += 1
        return result, None

    def cancel(self) -> None:
        self.cancelled = True


async def _deltas(schema: _ModelSchema, results: list[_Result], stop: tuple[str, ...], max_tokens: int = 16) -> list[Delta]:
    request = GenerationRequest(request_id="r", prompt="hi", max_tokens=max_tokens, stop=stop)
    return [d async for d in _backend_with(schema, _Stream(results)).generate(request)]


def _texts(deltas: list[Delta]) -> list[tuple[str, str | None]]:
    return [(d.text, d.finish_reason) for d in deltas]


@pytest.mark.asyncio
async def test_the_ensemble_text_is_cut_at_a_stop_that_spans_responses_and_the_stream_is_cancelled() -> None:
    """TensorRT-LLM leaves the stop in the text and may go on after it: the backend holds back what may
    begin a stop ("EN"), cuts before it, ends with "stop" and cancels the call (" never" is never read)."""
    stream = _Stream([_Result(t) for t in ("Hello", " wor", "ld", "EN", "D and more", " never", "!")])
    backend = _backend_with(ENSEMBLE, stream)
    request = GenerationRequest(request_id="r", prompt="hi", max_tokens=16, stop=("END",))
    deltas = [d async for d in backend.generate(request)]
    assert _texts(deltas) == [("Hello", None), (" wor", None), ("ld", None), ("", None), ("", "stop")]
    assert deltas[-1].completion_tokens == 5  # one token per response, as for any ending of the ensemble
    assert stream.cancelled and stream.read == 5


@pytest.mark.asyncio
async def test_a_false_start_of_a_stop_is_sent_once_the_next_response_rules_it_out() -> None:
    results = [_Result(t) for t in ("a\n", "b\n", "\n", "c")]
    assert _texts(await _deltas(ENSEMBLE, results, ("\n\n",))) == [("a", None), ("\nb", None), ("", "stop")]


@pytest.mark.asyncio
async def test_the_first_stop_of_several_wins_and_a_stop_inside_one_response_is_cut() -> None:
    results = [_Result("ab xyz b"), _Result("more")]
    assert _texts(await _deltas(ENSEMBLE, results, ("xyz", "b "))) == [("a", "stop")]  # the earliest, not the first listed


@pytest.mark.asyncio
async def test_what_is_held_back_goes_out_with_the_end_and_the_ending_is_the_models() -> None:
    final = [_Result("xE"), _Result("N", final=True)]  # Triton's final flag, after max_tokens responses
    assert _texts(await _deltas(ENSEMBLE, final, ("END",), max_tokens=2)) == [("x", None), ("EN", "length")]
    closed = [_Result("xE"), _Result("N")]  # the server closes the stream without a flagged response
    assert _texts(await _deltas(ENSEMBLE, closed, ("END",))) == [("x", None), ("", None), ("EN", "stop")]
    assert "".join(d.text for d in await _deltas(ENSEMBLE, closed, ())) == "xEN"


@pytest.mark.asyncio
async def test_sluice_llm_text_already_cut_passes_through_with_its_ending_and_counts() -> None:
    """sluice_llm cuts stops itself, so its text holds none: cutting again changes no text, ending or
    count (an "a" that may begin "ab" only waits one response longer)."""
    results = [_Result("a"), _Result("a"), _Result("", final=True, finish="stop", counts=(7, 3))]
    deltas = await _deltas(SLUICE_LLM, results, ("ab",))
    assert _texts(deltas) == [("", None), ("a", None), ("a", "stop")]
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (7, 3)
    plain = await _deltas(SLUICE_LLM, [_Result("a"), _Result("a"), _Result("", final=True, finish="stop", counts=(7, 3))], ())
    assert "".join(d.text for d in plain) == "aa" and plain[-1].finish_reason == "stop"


@pytest.mark.asyncio
async def test_a_character_split_between_responses_comes_out_whole_in_the_second() -> None:
    """The ensemble's postprocessing sends each token's bytes: 😀 is three tokens of SmolLM2, so its bytes
    may end one response and begin the next. Each response decoded on its own gave U+FFFD (or raised)."""
    emoji = "\N{GRINNING FACE}".encode()
    results = [_Result(b"Hi " + emoji[:1]), _Result(emoji[1:3]), _Result(emoji[3:] + b"!")]
    whole = [("Hi ", None), ("", None), ("\N{GRINNING FACE}!", None), ("", "stop")]
    assert _texts(await _deltas(ENSEMBLE, results, ())) == whole
    cut = await _deltas(ENSEMBLE, [_Result(b"a" + emoji[:2]), _Result(emoji[2:] + b"ENDx")], ("END",))
    assert _texts(cut) == [("a", None), ("\N{GRINNING FACE}", "stop")]
    dangling = await _deltas(ENSEMBLE, [_Result(b"ok " + emoji[:2], final=True)], (), max_tokens=1)
    assert _texts(dangling) == [("ok \ufffd", "length")]  # the stream ended inside a character


class _Odd(_Result):
    """A response whose outputs are `outputs` as they are."""

    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        super().__init__("", final=True)
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "outputs",
    [
        {},  # a model that does not produce text_output
        {"text_output": np.array([[7]], dtype=np.int32)},
        {"text_output": np.array([[b"x"]], dtype=np.object_), "finish_reason": np.array([[b"stop"]], dtype=np.object_),
         "prompt_tokens": np.array([[b"seven"]], dtype=np.object_)},
    ],
)
async def test_a_response_the_backend_cannot_read_is_a_model_error(outputs: dict[str, np.ndarray]) -> None:
    """No text_output, or an output of another type than the backend reads: the model's failure,
    retriable elsewhere and counted against its health. It was an AttributeError or ValueError (which the
    runner takes for a bug in sluice: dead letter, `internal`) or an integer passed off as text."""
    with pytest.raises(ModelError, match="text_output|prompt_tokens"):
        await _deltas(SLUICE_LLM, [_Odd(outputs)], ())


def _config_json(config: object) -> dict[str, object]:
    """A model config as `get_model_config(as_json=True)` returns it."""
    return {"config": json_format.MessageToDict(config, preserving_proto_field_name=True)}  # type: ignore[arg-type]


def _sluice_llm_config() -> object:
    path = Path(__file__).resolve().parents[2] / "triton_models" / "sluice_llm" / "config.pbtxt"
    return text_format.Parse(path.read_text(), mc.ModelConfig())


class _ConfigClient:
    """A server that answers the model config `config` and records the streams asked for."""

    def __init__(self, config: dict[str, object]) -> None:
        self.config, self.streams = config, 0

    async def get_model_config(self, model: str, as_json: bool = False) -> dict[str, object]:
        return self.config

    def stream_infer(self, inputs: object) -> object:
        self.streams += 1
        return _Stream([_Result("x", final=True)])


def _retyped(config: object, name: str, data_type: int) -> object:
    changed = mc.ModelConfig()
    changed.CopyFrom(config)  # type: ignore[arg-type]
    next(t for t in [*changed.input, *changed.output] if t.name == name).data_type = data_type
    return changed


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("config", "words"),
    [
        (tensorrt_llm_config(OPTIONS), ("no output `text_output`", "input_ids", "no input `text_input`")),
        (_retyped(ensemble_config(OPTIONS), "max_tokens", mc.TYPE_FP32), ("`max_tokens` is TYPE_FP32",)),
        (_retyped(_sluice_llm_config(), "text_output", mc.TYPE_INT32), ("`text_output` is TYPE_INT32",)),
    ],
)
async def test_a_model_sluice_cannot_drive_is_refused_when_its_config_is_read(
    config: object, words: tuple[str, ...]
) -> None:
    """`triton_model = "tensorrt_llm"` (the engine, token ids in and out) or a model whose tensors have
    other types: a clear ModelError before any request is sent, and the config is read again next time."""
    client = _ConfigClient(_config_json(config))
    backend = TritonBackend("127.0.0.1:1", "m")
    backend._connected = lambda: client  # type: ignore[method-assign,assignment,return-value]
    for _ in range(2):
        with pytest.raises(ModelError) as caught:
            [d async for d in backend.generate(GenerationRequest("r", prompt="hi", max_tokens=2))]
        assert all(w in str(caught.value) for w in words), str(caught.value)
    assert client.streams == 0 and not backend.resumes


@pytest.mark.asyncio
@pytest.mark.parametrize("config", [ensemble_config(OPTIONS), _sluice_llm_config()])
async def test_the_shipped_models_pass_the_config_check(config: object) -> None:
    client = _ConfigClient(_config_json(config))
    backend = TritonBackend("127.0.0.1:1", "m")
    backend._connected = lambda: client  # type: ignore[method-assign,assignment,return-value]
    assert _texts([d async for d in backend.generate(GenerationRequest("r", prompt="hi", max_tokens=2))]) == [("x", "stop")]

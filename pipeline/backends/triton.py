"""A model on a Triton Inference Server as a backend: `tritonclient.grpc.aio` `stream_infer`, one gRPC
stream per request.

The tensors are TensorRT-LLM's ensemble's (`text_input`, `max_tokens`, `stream`, `temperature`, `top_p`,
`random_seed`, `stop_words` in; `text_output` out), so the same backend serves `sluice_llm` (sluice's
engine in Triton, triton_models/sluice_llm) and a TensorRT-LLM `ensemble` or `tensorrt_llm_bls` on a GPU
host. The model's config is read once; an input or output is sent or asked for only when the model
declares it, and a model that lacks `text_input`, `max_tokens` or `text_output`, declares one of sluice's
tensors with another type, or requires an input sluice does not always send (`tensorrt_llm` itself,
whose input is token ids) is refused then, as a `ModelError`. `text_output` is UTF-8 decoded across the
responses of a stream, so a character split between two responses (the ensemble's postprocessing sends
each token's bytes) comes out whole, in the second. sluice_llm's extensions:

    messages            chat messages as JSON, the chat template applied by the model (a model without
                        this input takes a `prompt` only)
    resume_text         the completion text already delivered: the model continues after it (sluice_llm
                        re-tokenises it and samples as if it had generated it, `max_tokens` counting those
                        tokens too, as the local backend's resume does; see `resumes`)
    tenant              prefix-cache isolation
    finish_reason, prompt_tokens, completion_tokens   on the final response; from a model without them the
                        ending is inferred at the response Triton marks final (`triton_final_response`) or
                        when the stream closes: "length" once max_tokens responses came, else "stop", the
                        completion counted as one token per response (TensorRT-LLM's streaming sends one
                        token per response) and the prompt left uncounted

Cancellation: `cancel` (and a consumer closing the iterator) cancels the gRPC call; Triton cancels the
request and the model sees `request.is_cancelled()` (sluice_llm drops the sequence from its batch within
the step). Errors: a stream's error message from sluice_llm starts with the backend error's class
(`sluice.InvalidRequest: ...`, `sluice.Overloaded: ...` when its queue is full) and is raised as that
class; Triton's refusal of one over a queue's bound is `Overloaded` (retriable: sent on to the route's
next backend before a first chunk); anything else is `ModelError`, retriable on another backend and
counted against this one's health: an unknown or unloaded model, a failed step, the server gone, no
response within `timeout_s`, a response without a `text_output` of strings, and Triton's refusal of
tensors the model was said to take (an unexpected input, a data type or shape, a missing required
input: the deployed model is not the one its config described, which no client can fix).

Stop strings: the backend cuts the text itself, at the first occurrence of any of the request's stops,
whatever the model does with `stop_words` (TensorRT-LLM matches them as token ids, leaves the matched
stop in the text, and misses a stop the model writes with other tokens; sluice_llm's text never holds
one, its engine cuts them, so there the cut changes no text, only when a tail that may begin a stop goes
out). A tail that may begin a stop (at most the longest stop less one character) is held back until the
next response or the end; once a stop completes, the delta ends with finish "stop" and the gRPC call is
cancelled, so the model stops.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from pipeline.backends.base import Delta, FinishReason, GenerationRequest
from pipeline.backends.errors import BackendClosed, BackendError, Cancelled, InvalidRequest, ModelError, Overloaded
from pipeline.backends.text_stream import TextStream

__all__ = ["TritonBackend"]

_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled (a cancel may come before its generate)
_SLUICE_ERROR = re.compile(r"sluice\.(\w+): ")
_SLUICE_ERRORS: dict[str, type[BackendError]] = {
    cls.__name__: cls for cls in (Cancelled, InvalidRequest, ModelError, BackendClosed, Overloaded)
}
# Triton's own words for a request whose tensors the model does not declare so. sluice builds every
# tensor from the model's config, so these mean the deployed model is not what that config said (or not
# a model sluice can drive): the backend's fault, not the client's, and another backend may serve it.
_TRITON_SCHEMA_REFUSALS = ("unexpected inference input", "missing required input", "data-type", "unexpected shape")
# ... and for one it refuses for load (a model whose scheduler has a queue policy with max_queue_size).
_TRITON_OVERLOADED = ("exceeds maximum queue size",)
# What the backend may send, with the type the model must declare for it (the wire's type follows), and
# what of it goes with every request (a model may require only those: the others go when a request has
# them, a seed, stops, chat messages, delivered text, greedy sampling).
_INPUT_TYPES = {
    "text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "stream": "TYPE_BOOL", "temperature": "TYPE_FP32",
    "top_p": "TYPE_FP32", "top_k": "TYPE_INT32", "random_seed": "TYPE_UINT64", "stop_words": "TYPE_STRING",
    "messages": "TYPE_STRING", "resume_text": "TYPE_STRING", "tenant": "TYPE_STRING",
}
_ALWAYS_SENT = frozenset({"text_input", "max_tokens", "stream", "temperature", "top_p", "tenant"})
_NEEDED_INPUTS = ("text_input", "max_tokens")
# What the backend reads, with the types it can read; only text_output is needed.
_INTEGERS = tuple(f"TYPE_{sign}INT{bits}" for sign in ("", "U") for bits in (8, 16, 32, 64))
_OUTPUT_TYPES = {
    "text_output": ("TYPE_STRING",), "finish_reason": ("TYPE_STRING",), "prompt_tokens": _INTEGERS,
    "completion_tokens": _INTEGERS,
}
_EXTENSION_OUTPUTS = ("finish_reason", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class _ModelSchema:
    """What the model declares: its input and output names and whether it batches (inputs get [1, n])."""

    inputs: frozenset[str]
    outputs: tuple[str, ...]
    batched: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _ModelSchema:
        config = config.get("config", config)
        return cls(
            inputs=frozenset(i["name"] for i in config.get("input", [])),
            outputs=tuple(o["name"] for o in config.get("output", [])),
            batched=int(config.get("max_batch_size", 0)) > 0,
        )


def _schema_problems(config: dict[str, Any]) -> list[str]:
    """Why sluice cannot drive a model of this config (the JSON of `get_model_config`), if it cannot: an
    input or output it needs missing, one it sends or reads declared with another type, an input the
    model requires that sluice does not send with every request (e.g. `tensorrt_llm`'s `input_ids`: the
    engine model itself, not the ensemble in front of it)."""
    config = config.get("config", config)
    inputs = {i["name"]: i for i in config.get("input", [])}
    outputs = {o["name"]: o for o in config.get("output", [])}
    problems = [f"no input `{name}`" for name in _NEEDED_INPUTS if name not in inputs]
    if "text_output" not in outputs:
        problems.append(f"no output `text_output` (outputs: {', '.join(outputs) or 'none'})")
    problems += [
        f"input `{name}` is {inputs[name].get('data_type')}, sluice sends {kind}"
        for name, kind in _INPUT_TYPES.items() if name in inputs and inputs[name].get("data_type") != kind
    ]
    for name, kinds in _OUTPUT_TYPES.items():
        if name in outputs and outputs[name].get("data_type") not in kinds:
            wanted = "integers" if kinds is _INTEGERS else kinds[0]
            problems.append(f"output `{name}` is {outputs[name].get('data_type')}, sluice reads {wanted}")
    required = sorted(n for n, i in inputs.items() if not i.get("optional") and n not in _ALWAYS_SENT)
    if required:
        problems.append(f"it requires inputs sluice does not send with every request: {', '.join(required)}")
    return problems


class TritonBackend:
    def __init__(self, url: str, model: str, *, name: str = "triton", timeout_s: float = 60.0) -> None:
        """`url` is the server's gRPC address (host:port, from the config file only); `model` the name
        of a decoupled model in its repository; `timeout_s` bounds the wait for each response."""
        if not url or "://" in url:
            raise ValueError(f"backend {name}: url must be a gRPC host:port, got {url!r}")
        self.name = name
        self._url = url
        self._model = model
        self._timeout_s = timeout_s
        self._client: InferenceServerClient | None = None
        self._schema: _ModelSchema | None = None
        self._calls: dict[str, Any] = {}  # request id -> its running gRPC stream
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    @property
    def resumes(self) -> bool:
        """Whether a request's `resume_text` is continued after (the model takes it), once the model's
        config has been read (before that: False)."""
        return self._schema is not None and "resume_text" in self._schema.inputs

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        rid = request.request_id
        if rid in self._cancelled:
            raise Cancelled(f"request {rid} was cancelled")
        schema = await self._model_schema()
        if rid in self._cancelled:  # cancelled while the model's config was read: no call to cancel yet
            raise Cancelled(f"request {rid} was cancelled")
        payload = {
            "model_name": self._model,
            "request_id": rid,  # in Triton's logs and traces
            "inputs": _inputs(request, schema),
            "outputs": [InferRequestedOutput(name) for name in ("text_output", *_EXTENSION_OUTPUTS) if name in schema.outputs],
        }
        call = self._connected().stream_infer(_once(payload))
        self._calls[rid] = call
        responses = 0
        stops = _StopCut(request.stop) if request.stop else None
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span responses
        try:
            while (result := await self._next(call, rid)) is not None:
                responses += 1
                delta = self._delta(result, utf8)
                if delta.finish_reason is None and _final(result):  # a model that does not say why it ended
                    delta = Delta(delta.text, (), _inferred_finish(responses, request), None, responses)
                if delta.finish_reason is not None:  # the end: a character left incomplete shows as U+FFFD
                    delta = replace(delta, text=delta.text + utf8.decode(b"", final=True))
                if stops is not None:
                    delta = stops.cut(delta, responses)
                yield delta
                if delta.finish_reason is not None:
                    return  # the call is cancelled below: after a stop string the model may still be generating
            if "finish_reason" in schema.outputs or not responses:  # nothing at all is no answer, not an empty one
                raise ModelError(f"{self._model}: the stream ended without a final response")
            last = Delta(utf8.decode(b"", final=True), (), _inferred_finish(responses, request), None, responses)
            yield last if stops is None else stops.cut(last, responses)
        finally:
            call.cancel()  # the request's stream ends here, whatever ended the iteration (a no-op once done)
            self._calls.pop(rid, None)

    async def cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()  # Triton cancels the request; the model sees request.is_cancelled()

    async def aclose(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _connected(self) -> InferenceServerClient:
        if self._client is None:  # created in the running loop (a gRPC aio channel belongs to one loop)
            self._client = InferenceServerClient(self._url)
        return self._client

    async def _model_schema(self) -> _ModelSchema:
        if self._schema is None:
            try:
                async with asyncio.timeout(self._timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                    config = await self._connected().get_model_config(self._model, as_json=True)
            except InferenceServerException as exc:
                raise ModelError(f"{self._model} on {self._url}: {exc.message()}") from None
            except TimeoutError:
                raise ModelError(f"{self._url} did not answer within {self._timeout_s} s") from None
            problems = _schema_problems(config)
            if problems:  # not kept: read again next time, as the model may be replaced meanwhile
                raise ModelError(
                    f"{self._model} on {self._url} is not a model sluice can drive ({'; '.join(problems)}); "
                    "`triton_model` names sluice_llm, an ensemble or tensorrt_llm_bls"
                )
            self._schema = _ModelSchema.from_config(config)
        return self._schema

    def _delta(self, result: InferResult, utf8: codecs.IncrementalDecoder) -> Delta:
        """One response as a delta; its text goes through `utf8`, which holds back a character's first
        bytes until the response with the rest (the ensemble's postprocessing sends each token's bytes)."""
        array = _output(result, "text_output", "O", self._model)
        if array is None:
            raise ModelError(f"{self._model}: a response without `text_output`")
        text = "".join(utf8.decode(v) if isinstance(v, bytes) else str(v) for v in array.reshape(-1))
        finish = _output(result, "finish_reason", "O", self._model)
        if finish is None or not finish.size:
            return Delta(text, ())
        reason = "length" if _text(finish.reshape(-1)[0]) == "length" else "stop"
        return Delta(text, (), reason, self._count(result, "prompt_tokens"), self._count(result, "completion_tokens"))

    def _count(self, result: InferResult, name: str) -> int | None:
        array = _output(result, name, "iu", self._model)
        return None if array is None or not array.size else int(array.reshape(-1)[0])

    async def _next(self, call: Any, rid: str) -> InferResult | None:
        """The next response of the stream (None once the server closed it), or the error it maps to."""
        try:
            # not wait_for: on 3.11 it returns a response that came in the turn a cancel (a revoke) did,
            # swallowing the cancel, and the task goes on reading the stream until it ends
            async with asyncio.timeout(self._timeout_s):
                result, error = await anext(call)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if rid in self._cancelled and (task is None or not task.cancelling()):
                raise Cancelled(f"request {rid} was cancelled") from None  # our cancel, not the task's
            raise
        except TimeoutError:
            raise ModelError(f"{self._model}: no response within {self._timeout_s} s") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and rid in self._cancelled:
                raise Cancelled(f"request {rid} was cancelled") from None
            raise ModelError(f"{self._url}: {exc.code().name}: {exc.details()}") from None
        if error is not None:
            raise _mapped(error.message())
        return result


class _StopCut:
    """A request's stop strings cut from a model's streamed text, with the local backend's holdback:
    each response's text is one "token" of a `TextStream` whose `token_text` is that text (texts that
    concatenate, which is what `token_text` asks for), so what may begin a stop waits for the next
    response and the text ends just before the first stop, by the same code as the engine's."""

    _END = -1  # the "token" that ends the stream (an end of sequence): what was held back goes out

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._texts: list[str] = []
        self._stream = TextStream(
            self._joined, completion_ids=(), sent_chars=0, stops=stops, max_tokens=sys.maxsize,
            eos_ids=(self._END,), token_text=self._text,
        )

    def cut(self, delta: Delta, responses: int) -> Delta:
        """`delta` with the text that may go out now: held back where a stop may be starting, cut before
        a stop that completed (the delta then ends with finish "stop"), and with everything held back
        when `delta` ends the stream."""
        self._texts.append(delta.text)
        sent = self._stream.push(len(self._texts) - 1)
        if sent.finish_reason is not None:  # a stop string completed: the answer ends before it
            if delta.finish_reason is None:
                return Delta(sent.text, delta.token_ids, "stop", None, responses)
            return replace(delta, text=sent.text, finish_reason="stop")
        if delta.finish_reason is None:
            return replace(delta, text=sent.text)
        held = self._stream.push(self._END).text  # the end: nothing held back can begin a stop any more
        return replace(delta, text=sent.text + held)

    def _text(self, index: int) -> str:
        return self._texts[index] if index >= 0 else ""

    def _joined(self, indices: Sequence[int]) -> str:
        return "".join(self._text(i) for i in indices)


async def _once(payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """One request on the stream; the client half-closes after it and the server closes the stream after
    the model's final response."""
    yield payload


def _inputs(request: GenerationRequest, schema: _ModelSchema) -> list[InferInput]:
    if bool(request.messages) == (request.prompt is not None):
        raise InvalidRequest("a request needs exactly one of `messages` (chat) and `prompt` (completion)")
    if request.messages and "messages" not in schema.inputs:
        raise InvalidRequest("this Triton model takes a prompt only (it has no `messages` input)")
    values: dict[str, np.ndarray] = {
        "text_input": _strings([request.prompt or ""]),
        "max_tokens": np.array([request.max_tokens], dtype=np.int32),
        "stream": np.array([True], dtype=np.bool_),
        "temperature": np.array([request.temperature], dtype=np.float32),
        "top_p": np.array([request.top_p], dtype=np.float32),
    }
    if request.temperature == 0.0 and "top_k" in schema.inputs:
        # TensorRT-LLM decodes greedily only with top_k 1 (or top_k and top_p both 0): temperature 0 with
        # top_p 1 samples there, so sluice's greedy default, and a resume that asks again, would not be
        values["top_k"] = np.array([1], dtype=np.int32)
    if request.seed is not None:
        values["random_seed"] = np.array([request.seed & (2**64 - 1)], dtype=np.uint64)
    if request.stop:
        values["stop_words"] = _strings(request.stop)
    if request.messages:
        values["messages"] = _strings([json.dumps([{"role": m.role, "content": m.content} for m in request.messages])])
    if request.resume_text:
        if "resume_text" not in schema.inputs:
            raise InvalidRequest("this Triton model cannot continue after delivered text (no `resume_text` input)")
        values["resume_text"] = _strings([request.resume_text])
    if "tenant" in schema.inputs:
        values["tenant"] = _strings([request.tenant])
    inputs = []
    for name, array in values.items():
        if name not in schema.inputs:
            continue  # an optional knob the model does not have (e.g. a model without stop_words)
        array = array.reshape(1, -1) if schema.batched else array
        tensor = InferInput(name, list(array.shape), _wire_type(_INPUT_TYPES[name]))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _wire_type(config_type: str) -> str:
    """A config's data type as the protocol names it (TYPE_STRING is BYTES, TYPE_INT32 is INT32)."""
    return "BYTES" if config_type == "TYPE_STRING" else config_type.removeprefix("TYPE_")


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def _output(result: InferResult, name: str, kinds: str, model: str) -> np.ndarray | None:
    """A response's output `name` (None when it has none), which must be of a numpy kind in `kinds`."""
    array = result.as_numpy(name)
    if array is not None and array.dtype.kind not in kinds:
        wanted = "strings" if kinds == "O" else "integers"
        raise ModelError(f"{model}: output `{name}` came as {array.dtype}, not {wanted}")
    return array


def _final(result: InferResult) -> bool:
    """Triton marks the final response of a decoupled model's request (`triton_final_response`)."""
    flag = result.get_response().parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


def _inferred_finish(responses: int, request: GenerationRequest) -> FinishReason:
    return "length" if responses >= request.max_tokens else "stop"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mapped(message: str) -> BackendError:
    """A stream's error message as the backend error it stands for."""
    match = _SLUICE_ERROR.search(message)
    if match is not None and match.group(1) in _SLUICE_ERRORS:
        return _SLUICE_ERRORS[match.group(1)](message[match.end():])
    if any(words in message.lower() for words in _TRITON_SCHEMA_REFUSALS):
        return ModelError(f"the model does not take the tensors its config declares: {message}")
    if any(words in message.lower() for words in _TRITON_OVERLOADED):
        return Overloaded(message)
    return ModelError(message)

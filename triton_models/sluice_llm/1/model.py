"""sluice_llm: sluice's own engine (`pipeline.engine`, through `LocalBackend`) inside Triton's Python backend.

    initialize          load the converted checkpoint once; one engine for the model instance
    execute (async)     one coroutine per request: parse the TensorRT-LLM-style inputs, stream
                        `LocalBackend.generate`'s deltas as responses, the last one flagged final
    cancellation        a watcher asks `request.is_cancelled()` of every live request as each engine step
                        starts (at least every CANCEL_CHECK_MAX_S); a cancelled one is cancelled in the
                        engine at once (its sequence leaves the batch, and the result of the step already
                        running is discarded for it), and its stream ends with the final flag
    bound               at most max_batch + max_queue_size requests are held (generating, or waiting for
                        a seat in the batch); one more is answered at once with `sluice.Overloaded` (code
                        UNAVAILABLE) instead of waiting behind them: the client tries another backend
    errors              a request the engine refuses and a failed model step become error responses whose
                        message starts with the backend error's class (`sluice.InvalidRequest: ...`), so a
                        client maps them back to the same class and policy (pipeline/backends/triton.py);
                        a text over `LocalBackend.max_input_bytes` is refused before it is tokenised
                        (tokenising runs on the event loop every request's stream and cancellation share)

Requests that arrive concurrently share one continuously batched engine: `async def execute` returns to
Triton's event loop while a request generates, so the next request starts at the next engine step
(Triton's in-flight batching, done by sluice's scheduler on CPU). The stub runs in .venv-triton (numpy < 2,
torch, transformers) with the repository root on PYTHONPATH; infra/triton/serve.sh sets both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from pipeline.backends.base import Delta, GenerationRequest, Message
from pipeline.backends.errors import BackendError, Cancelled, InvalidRequest, ModelError, Overloaded
from pipeline.backends.local import LocalBackend
from pipeline.models import MODEL_DIRNAME

# Every live request is asked `is_cancelled()` (an IPC round trip to the server each) once per engine step,
# while the step computes: a cancel then lands within a step, as on a clock of 25 ms (the poll until session
# 21), without 32 requests' polls every 25 ms (1,280 round trips a second) taking the model's CPU. When no
# step starts for this long (nothing scheduled), they are asked anyway.
CANCEL_CHECK_MAX_S = 0.25
# Requests held beyond the batch's seats unless config.pbtxt's `max_queue_size` says otherwise: eight batches of
# 32 waiting; a request past them is better sent to another backend (or retried) than queued.
DEFAULT_MAX_QUEUE_SIZE = 256
_ROLES = ("system", "user", "assistant")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        repository_root = Path(__file__).resolve().parents[3]
        model_dir = Path(params.get("model_dir") or repository_root / ".cache" / "models" / MODEL_DIRNAME)
        if not model_dir.exists():
            raise pb_utils.TritonModelException(f"{model_dir} is missing: run `make setup` to convert the default model")
        torch.set_num_threads(int(params.get("torch_threads", "2")))
        max_batch = int(params.get("max_batch", "32"))
        max_queue_size = int(params.get("max_queue_size") or DEFAULT_MAX_QUEUE_SIZE)
        if max_batch < 1 or max_queue_size < 0:
            raise pb_utils.TritonModelException(
                f"max_batch must be positive and max_queue_size not negative, got {max_batch} and {max_queue_size}"
            )
        self._bound = f"max_batch {max_batch} + max_queue_size {max_queue_size}"
        self._max_held = max_batch + max_queue_size  # requests generating or waiting for a seat
        self._backend = LocalBackend.from_path(
            model_dir, name=config["name"], max_batch=max_batch,
            gather_arrivals_ms=float(params.get("gather_arrivals_ms", "0")),
        )
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._live: dict[str, Any] = {}  # request id -> Triton request, while it generates
        self._watcher: asyncio.Task[None] | None = None

    async def execute(self, requests: list[Any]) -> None:
        await asyncio.gather(*(self._serve(request) for request in requests))

    async def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex  # Triton's request ids are the client's and need not be unique
        tokens = [0]  # completion tokens generated so far (for the log line of a cancellation)
        try:
            if len(self._live) >= self._max_held:  # no await from here until it is counted in _live
                raise Overloaded(f"sluice_llm holds {len(self._live)} requests ({self._bound}); retry elsewhere or later")
            generation, stream = self._parse(request, request_id)
            self._live[request_id] = request
            self._watch()
            await self._generate(generation, sender, stream, tokens)
        except Cancelled:
            pb_utils.Logger.log_info(
                f"sluice_llm: request {request.request_id()!r} cancelled after {tokens[0]} tokens; sequence dropped"
            )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except BackendError as exc:
            error = pb_utils.TritonError(f"sluice.{type(exc).__name__}: {exc}", _code(exc))
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # a bug here must still end the stream (else the client waits forever)
            pb_utils.Logger.log_error(f"sluice_llm: request failed: {exc!r}")
            error = pb_utils.TritonError(f"sluice.ModelError: unexpected {exc!r}", pb_utils.TritonError.INTERNAL)
            try:
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as closed:  # the failure was the final send itself: the sender is closed already
                pb_utils.Logger.log_error(f"sluice_llm: could not report the failure: {closed!r}")
        finally:
            self._live.pop(request_id, None)

    async def _generate(self, generation: GenerationRequest, sender: Any, stream: bool, tokens: list[int]) -> None:
        """Streaming: one response per delta with new text, the last one (with the ending and the counts)
        flagged final. `stream = false`: one final response with the whole completion (TensorRT-LLM's
        non-streaming mode)."""
        held: list[str] = []
        async for delta in self._backend.generate(generation):
            tokens[0] += len(delta.token_ids)
            held.append(delta.text)
            if delta.finish_reason is not None:
                prompt_tokens = self._backend.count_prompt_tokens(generation)
                final = _response("".join(held), delta, prompt_tokens, tokens[0])
                sender.send(final, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if stream:
                if delta.text:
                    sender.send(_response(delta.text))
                held.clear()
        raise ModelError("the engine's stream ended without a finish reason")

    def _parse(self, request: Any, request_id: str) -> tuple[GenerationRequest, bool]:
        """The TensorRT-LLM-style inputs (and sluice's extensions) as a `GenerationRequest`, and `stream`."""
        text = _scalar(request, "text_input")
        messages_json = _scalar(request, "messages")
        messages: tuple[Message, ...] = ()
        if messages_json:
            messages = _messages(messages_json)
        seed = _scalar(request, "random_seed")
        resume_text = _scalar(request, "resume_text") or ""
        self._backend.check_input_size("resume_text", resume_text)  # before tokenising, on the loop every stream shares
        resume_ids = tuple(self._tokenizer(resume_text, add_special_tokens=False)["input_ids"]) if resume_text else ()
        stops = _tensor(request, "stop_words")
        generation = GenerationRequest(
            request_id=request_id,
            messages=messages,
            prompt=None if messages else (text or ""),
            max_tokens=int(_scalar(request, "max_tokens")),
            temperature=float(_scalar(request, "temperature", 0.0)),
            top_p=float(_scalar(request, "top_p", 1.0)),
            stop=tuple(_text(s) for s in stops.reshape(-1)) if stops is not None else (),
            seed=int(seed) if seed is not None else None,
            tenant=_scalar(request, "tenant") or "default",
            resume_token_ids=tuple(int(t) for t in resume_ids),
            resume_text=resume_text,
        )
        return generation, bool(_scalar(request, "stream", False))

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_cancellations())

    async def _watch_cancellations(self) -> None:
        while self._live:
            for request_id, request in list(self._live.items()):
                try:
                    if request.is_cancelled():
                        self._live.pop(request_id, None)
                        await self._backend.cancel(request_id)
                except Exception as exc:  # one request's failure must not end the watch for the others
                    pb_utils.Logger.log_error(f"sluice_llm: cancellation check failed: {exc!r}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._backend.engine.next_step(), CANCEL_CHECK_MAX_S)


def _code(error: BackendError) -> Any:
    """The Triton error code of a backend error (the client goes by the message's class name; the code is
    for Triton's own logs and metrics)."""
    if isinstance(error, InvalidRequest):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(error, Overloaded):
        return pb_utils.TritonError.UNAVAILABLE
    return pb_utils.TritonError.INTERNAL


def _response(text: str, last: Delta | None = None, prompt_tokens: int = 0, completion_tokens: int = 0) -> Any:
    outputs = [pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_))]
    if last is not None:
        outputs += [
            pb_utils.Tensor("finish_reason", np.array([[str(last.finish_reason).encode()]], dtype=np.object_)),
            pb_utils.Tensor("prompt_tokens", np.array([[prompt_tokens]], dtype=np.int32)),
            pb_utils.Tensor("completion_tokens", np.array([[completion_tokens]], dtype=np.int32)),
        ]
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _tensor(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request: Any, name: str, default: Any = None) -> Any:
    """The single value of an input shaped [1, 1] (batch of one), decoded when it is a string."""
    array = _tensor(request, name)
    if array is None:
        return default
    if array.size != 1:
        raise InvalidRequest(f"input {name} must hold one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    return _text(value) if isinstance(value, bytes | str) else value.item()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _messages(raw: str) -> tuple[Message, ...]:
    try:
        items = json.loads(raw)
        messages = tuple(Message(role=item["role"], content=str(item["content"])) for item in items)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidRequest(f"messages must be a JSON list of {{role, content}} objects: {exc}") from None
    if not messages or any(m.role not in _ROLES for m in messages):
        raise InvalidRequest(f"messages must be non-empty, with roles among {_ROLES}")
    return messages

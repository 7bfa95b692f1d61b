"""The local backend: a Hugging Face causal LM run in-process with plain torch forwards.

    prefill(request)          tokenise, one forward, sample the first token, keep the KV state by handle
    decode(request, handle)   continue from the handle (or recompute it when gone), one token per step
    generate(request)         prefill then decode, the first token as the first delta
    cancel(request_id)        the request stops at its next step; its stream raises `Cancelled`

All model work goes through one `StepScheduler` (one task, one model thread), which advances every
running sequence by one token per step, so concurrent requests progress together.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence as Ids
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.backends.base import Delta, GenerationRequest, Prefilled
from pipeline.backends.errors import Cancelled, InvalidRequest
from pipeline.backends.kv_store import KVStore
from pipeline.backends.model_runner import ModelRunner
from pipeline.backends.sampling import SamplingParams
from pipeline.backends.scheduler import StepScheduler
from pipeline.backends.sequence import Sequence
from pipeline.backends.text_stream import TextStream
from pipeline.models import END_OF_TURN, load_model

__all__ = ["LocalBackend"]

_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled, so a later decode of one refuses to run


class LocalBackend:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str = "local",
        max_batch: int = 16,
        kv_capacity: int = 64,
    ) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self._runner = ModelRunner(model)
        self._scheduler = StepScheduler(self._runner, name=name, max_batch=max_batch)
        self._store = KVStore(kv_capacity)
        self._eos_ids = _eos_ids(model, tokenizer)
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def from_path(cls, path: Path, *, device: str = "cpu", name: str = "local", max_batch: int = 16) -> LocalBackend:
        """A backend over a checkpoint written by `pipeline.models.convert_default_model`."""
        model, tokenizer = load_model(path, device)
        return cls(model, tokenizer, name=name, max_batch=max_batch)

    @property
    def kv_store(self) -> KVStore:
        """Prefilled states waiting for their decode (dropping one makes its decode recompute)."""
        return self._store

    @property
    def active_sequences(self) -> int:
        """Sequences waiting for or inside a model step."""
        return self._scheduler.active

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._prompt_ids(request))

    async def prefill(self, request: GenerationRequest) -> Prefilled:
        self._refuse_if_cancelled(request.request_id)
        prompt_ids = self._prompt_ids(request)
        self._validate(request, len(prompt_ids))
        resume = list(request.resume_token_ids)
        first: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        sequence = Sequence(
            request_id=request.request_id,
            pending_ids=prompt_ids + resume,
            sampling=SamplingParams.of(request.temperature, request.top_p, request.seed),
            position=len(resume),
            sink=_FirstTokenSink(first),
        )
        self._scheduler.submit(sequence)
        try:
            token = await first
        finally:
            if not first.done() or first.cancelled():
                self._scheduler.release(sequence)
        if request.request_id in self._cancelled:  # cancelled after the step, before the state was stored
            sequence.cache = None
            raise Cancelled(f"request {request.request_id} was cancelled")
        delta = self._text_stream(request).push(token)
        handle = uuid.uuid4().hex
        if delta.finish_reason is None:
            self._store.put(handle, sequence)
        else:
            sequence.cache = None
        return Prefilled(handle, token, delta.text, len(prompt_ids), delta.finish_reason)

    async def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        if prefilled.finish_reason is not None:
            self._store.drop(prefilled.handle)
            return
        if request.request_id in self._cancelled:
            self._store.drop(prefilled.handle)
            raise Cancelled(f"request {request.request_id} was cancelled")
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        sink = _DeltaSink(self._text_stream(request, prefilled), queue)
        sequence = self._store.take(prefilled.handle, request.request_id)
        if sequence is None:
            sequence = self._recompute(request, prefilled, sink)
        sequence.sink = sink
        self._scheduler.submit(sequence)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._scheduler.release(sequence)  # a no-op when the sequence already left the scheduler

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        prefilled = await self.prefill(request)
        first = Delta(prefilled.first_text, (prefilled.first_token_id,), prefilled.finish_reason)
        stream = self.decode(request, prefilled)
        try:
            yield first
            if prefilled.finish_reason is None:
                async for delta in stream:
                    yield delta
        finally:
            await stream.aclose()
            self._store.drop(prefilled.handle)  # the consumer left before decode took the state

    async def cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        self._store.drop_request(request_id)
        self._scheduler.cancel(request_id, lambda: Cancelled(f"request {request_id} was cancelled"))

    async def aclose(self) -> None:
        """Stop the step loop and the model thread; running requests end with `BackendClosed`."""
        await self._scheduler.aclose()

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if bool(request.messages) == (request.prompt is not None):
            raise InvalidRequest("a request needs exactly one of `messages` (chat) and `prompt` (completion)")
        if request.messages:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            return [int(t) for t in self._tokenizer.apply_chat_template(chat, add_generation_prompt=True)]
        return [int(t) for t in self._tokenizer(request.prompt, add_special_tokens=False)["input_ids"]]

    def _validate(self, request: GenerationRequest, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        if request.max_tokens < 1 or len(request.resume_token_ids) >= request.max_tokens:
            raise InvalidRequest(
                f"nothing to generate: max_tokens={request.max_tokens}, resume tokens={len(request.resume_token_ids)}"
            )
        if request.temperature < 0.0 or not 0.0 < request.top_p <= 1.0:
            raise InvalidRequest(f"bad sampling parameters: temperature={request.temperature}, top_p={request.top_p}")
        if prompt_tokens + request.max_tokens > self._runner.context_length:
            raise InvalidRequest(
                f"prompt ({prompt_tokens}) + max_tokens ({request.max_tokens}) exceeds the context "
                f"of {self._runner.context_length} tokens"
            )

    def _refuse_if_cancelled(self, request_id: str) -> None:
        if request_id in self._cancelled:
            raise Cancelled(f"request {request_id} was cancelled")

    def _recompute(self, request: GenerationRequest, prefilled: Prefilled, sink: _DeltaSink) -> Sequence:
        """Rebuild a sequence whose KV state is gone: the next step prefills prompt, resume and first token."""
        resume = list(request.resume_token_ids)
        return Sequence(
            request_id=request.request_id,
            pending_ids=self._prompt_ids(request) + resume + [prefilled.first_token_id],
            sampling=SamplingParams.of(request.temperature, request.top_p, request.seed),
            position=len(resume) + 1,
            sink=sink,
        )

    def _text_stream(self, request: GenerationRequest, prefilled: Prefilled | None = None) -> TextStream:
        common = {"stops": request.stop, "max_tokens": request.max_tokens, "eos_ids": self._eos_ids}
        resume = request.resume_token_ids
        if prefilled is None:
            return TextStream.start(self._detokenize, resume_ids=resume, **common)
        return TextStream.after_first(
            self._detokenize,
            resume_ids=resume,
            first_token_id=prefilled.first_token_id,
            first_text=prefilled.first_text,
            **common,
        )

    def _detokenize(self, ids: Ids[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))


class _FirstTokenSink:
    """Resolves `prefill`'s future with the first token; the sequence then waits in the KV store."""

    def __init__(self, future: asyncio.Future[int]) -> None:
        self._future = future

    def on_token(self, token_id: int) -> bool:
        if not self._future.done():
            self._future.set_result(token_id)
        return True

    def on_error(self, error: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(error)


class _DeltaSink:
    """Turns each token into a `Delta` on the decode iterator's queue; finished when a delta has a reason."""

    def __init__(self, stream: TextStream, queue: asyncio.Queue[Delta | BaseException]) -> None:
        self._stream = stream
        self._queue = queue

    def on_token(self, token_id: int) -> bool:
        delta = self._stream.push(token_id)
        self._queue.put_nowait(delta)
        return delta.finish_reason is not None

    def on_error(self, error: BaseException) -> None:
        self._queue.put_nowait(error)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Tokens that end a completion: the model's and tokenizer's EOS and the chat end-of-turn token."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end_of_turn = tokenizer.get_vocab().get(END_OF_TURN)
    if end_of_turn is not None:
        ids.add(int(end_of_turn))
    return frozenset(ids)

"""The local backend: the project's engine (`pipeline.engine`) run in-process, text in and out.

    prefill(request)          tokenise (in the backend's tokenising thread, off the event loop), compute
                              the prompt, sample the first token; the sequence is parked in the engine
                              (its KV blocks kept) under the returned handle; a prompt over
                              `max_input_bytes` is refused before it is tokenised
    hand_off(prefilled)       with a KV store: leave the parked sequence's KV there under its handle,
                              for a decode worker in another process
    decode(request, handle)   resume the parked sequence; else import its KV from the store; else
                              (the handle is gone: expired, evicted, another host) recompute it; a
                              handle naming another request's KV (a stale or forged record) is
                              neither used nor freed
    generate(request)         prefill then decode, the first token as the first delta
    cancel(request_id)        every sequence of the request stops at once; its stream raises `Cancelled`

The engine batches every running sequence into one forward per step (continuous batching, chunked
prefill, paged KV with prefix reuse); this module only turns token ids into deltas (`TextStream`)
and engine errors into backend errors.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from collections.abc import Sequence as Ids
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from pipeline.backends.base import Delta, GenerationRequest, Prefilled
from pipeline.backends.errors import BackendClosed, BackendError, Cancelled, InvalidRequest, ModelError
from pipeline.backends.text_stream import TextStream
from pipeline.chat_template import chat_prompt_ids
from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.config import EngineConfig
from pipeline.engine.errors import (
    EngineClosed,
    EngineError,
    KVMismatch,
    RequestTooLarge,
    SequenceAborted,
    StepFailed,
    UnknownHandle,
)
from pipeline.engine.kv_store import KVStore
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.params import EngineRequest, Priority, SamplingParams, SpeculativeParams
from pipeline.models import END_OF_TURN

__all__ = ["HandoffCounts", "LocalBackend"]

log = logging.getLogger(__name__)

_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled, so a later decode of one refuses to run
# Input text is refused before it is tokenised past this many UTF-8 bytes for each token of the model's
# context. Tokenising costs about 1 s a MB, in the tokenising thread (prefill, decode; every prompt queued
# behind it waits) or on the caller's event loop (`count_prompt_tokens`, sluice_llm's `resume_text`: 21 MB
# held every stream and cancellation of Triton's loop for 17 s); a text that could fit the context is far
# below it (English runs about 4 bytes a token; only a text made of the vocabulary's longest tokens, long
# runs of spaces or symbols, could pass 16 and still fit, and is refused).
MAX_BYTES_PER_TOKEN = 16


@dataclass
class HandoffCounts:
    """How decodes found their KV since start (for tests, benchmarks and logs)."""

    published: int = 0  # prefilled sequences left in the KV store
    local: int = 0  # decodes that found their sequence parked in this process
    imported: int = 0  # decodes that imported it from the KV store
    recomputed: int = 0  # decodes that recomputed prompt + tokens (the handle was gone)


class LocalBackend:
    def __init__(
        self,
        model: PreTrainedModel | ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str = "local",
        max_batch: int = 16,
        kv_capacity: int = 64,
        eos_ids: frozenset[int] | None = None,
        engine_config: EngineConfig | None = None,
        kv_store: KVStore | None = None,
        speculative: SpeculativeParams | None = None,
    ) -> None:
        """`model` is a transformers Llama-family model (its weights are shared, not copied) or a
        ready `ModelRunner`; `max_batch` sequences run per step, `kv_capacity` prefilled ones wait;
        `kv_store` is where prefilled KV waits for decode workers in other processes (None: nowhere);
        `speculative` turns on n-gram speculative decoding for every request (None: off)."""
        self.name = name
        self._tokenizer = tokenizer
        config = engine_config or EngineConfig(max_num_seqs=max_batch, max_parked=kv_capacity)
        runner = model if isinstance(model, ModelRunner) else ModelRunner.from_transformers(model, config)
        self._context_length = runner.model_config.max_position_embeddings
        self.max_input_bytes = MAX_BYTES_PER_TOKEN * self._context_length  # see `check_input_size`
        self._vocab_size = runner.model_config.vocab_size
        self._handles_bound = 2 * (config.max_parked + config.max_num_seqs) + 64  # see `_prune_handles`
        self._engine = AsyncEngine(LLMEngine(runner), name=name)
        generation = None if isinstance(model, ModelRunner) else model.generation_config
        self._eos_ids = eos_ids if eos_ids is not None else _eos_ids(generation, tokenizer)
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._handles: dict[str, set[str]] = {}  # request id -> handles of its live sequences
        self._store = kv_store
        self._speculative = speculative
        self.handoffs = HandoffCounts()
        # Prompts are tokenised in a thread of their own: on the event loop, a poll batch's burst of
        # prefills (64 tasks, each tokenising before its first await) held it 0.86 s for 64 prompts of
        # 32 KiB, 1 s for 16 of 128 KiB. One thread, and a lock for `count_prompt_tokens`, because the
        # tokenizer is one object whose `split_special_tokens` switch every call sets: two calls at once
        # fail ("Already borrowed") or tokenise a client's typed `<|im_start|>` as a control token.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-tokenize")
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def from_path(
        cls, path: Path, *, device: str = "cpu", name: str = "local", max_batch: int = 16,
        kv_store: KVStore | None = None, speculative: SpeculativeParams | None = None, dtype: str = "float32",
        interrupt_batch_steps: float = 1.0, gather_arrivals_ms: float = 0.0,
    ) -> LocalBackend:
        """A backend over a checkpoint written by `pipeline.models.convert_default_model` (weights are
        read straight into the engine, in `dtype`; no transformers model is built); `interrupt_batch_steps`
        and `gather_arrivals_ms` as `EngineConfig` takes them."""
        config = EngineConfig(max_num_seqs=max_batch, device=device, dtype=dtype, interrupt_batch_steps=interrupt_batch_steps,
                              gather_arrivals_ms=gather_arrivals_ms)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        runner = ModelRunner.from_path(path, config)
        return cls(
            runner, tokenizer, name=name, eos_ids=_eos_ids(generation, tokenizer), engine_config=config,
            kv_store=kv_store, speculative=speculative,
        )

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def kv_store(self) -> _ParkedView:
        """Prefilled states waiting for their decode (dropping one makes its decode recompute)."""
        return _ParkedView(self._engine)

    @property
    def active_sequences(self) -> int:
        """Sequences waiting for or inside a model step."""
        return self._engine.num_active

    def check_input_size(self, what: str, *texts: str) -> None:
        """Refuse (`InvalidRequest`) texts that together are over `max_input_bytes`, before anything
        tokenises them: they cannot fit the context."""
        size = sum(len(text.encode()) for text in texts)
        if size > self.max_input_bytes:
            raise InvalidRequest(
                f"{what} is {size} bytes, more than could fit the context of {self._context_length} tokens "
                f"({self.max_input_bytes} bytes, {MAX_BYTES_PER_TOKEN} a token); refused before tokenising"
            )

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Tokenises on the calling thread (waiting while the tokenising thread works)."""
        return len(self._prompt_ids(request))

    async def prefill(self, request: GenerationRequest) -> Prefilled:
        self._refuse_if_cancelled(request.request_id)
        prompt_ids = await self._prompt_ids_in_thread(request)
        self._refuse_if_cancelled(request.request_id)  # cancelled while it was tokenised
        self._validate(request, len(prompt_ids))
        with self._tracked(request.request_id) as handle, _engine_errors():
            token, _ = await self._engine.prefill(self._engine_request(request, prompt_ids), handle=handle)
        if request.request_id in self._cancelled:  # cancelled after the step, before the state was kept
            self._engine.cancel(handle)
            raise Cancelled(f"request {request.request_id} was cancelled")
        delta = self._text_stream(request).push(token)
        if delta.finish_reason is None:
            self._handles.setdefault(request.request_id, set()).add(handle)
            self._prune_handles()
        else:
            self._engine.cancel(handle)
        return Prefilled(handle, token, delta.text, len(prompt_ids), delta.finish_reason)

    async def hand_off(self, prefilled: Prefilled) -> bool:
        """Leave the parked sequence's KV in the KV store under its handle (it also stays parked here,
        for a decode in this process, until the engine needs its blocks). False when there is no store,
        nothing to hand off, or the store could not keep it: a decode elsewhere then recomputes."""
        if self._store is None or prefilled.finish_reason is not None:
            return False
        store = self._store
        try:
            async with self._engine.exported(prefilled.handle) as parts:
                kept = await asyncio.to_thread(store.put, prefilled.handle, parts)
        except UnknownHandle:  # cancelled or dropped since prefill
            return False
        except OSError as exc:  # policy: the KV store is an optimisation; decode recomputes without it
            log.warning("backend=%s KV store write failed (%s); decode will recompute", self.name, exc)
            return False
        self.handoffs.published += kept
        return kept

    async def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        if prefilled.finish_reason is not None:
            if self._parked_by(request.request_id, prefilled.handle):
                self._engine.cancel(prefilled.handle)
            return
        if request.request_id in self._cancelled:  # `cancel` freed what it parked here; the stored KV, not
            raise Cancelled(f"request {request.request_id} was cancelled")  # known to be its unless imported, waits for its TTL
        ids = (*request.resume_token_ids, prefilled.first_token_id)  # from a Kafka message: an id past the
        if not all(0 <= i < self._vocab_size for i in ids):  # vocabulary would fail the step of every request in it
            raise InvalidRequest("a token id of the handoff is outside the model's vocabulary")
        stream = self._text_stream(request, prefilled)
        handle, tokens, ours = await self._resume(request, prefilled)
        if request.request_id in self._cancelled:  # cancelled while the KV was read and imported
            self._engine.cancel(handle)
            if ours:
                await self._discard_stored(prefilled.handle)
            raise Cancelled(f"request {request.request_id} was cancelled")
        self._handles.setdefault(request.request_id, set()).add(handle)
        ended = False  # finished or cancelled: the stored KV is of no further use
        try:
            with _engine_errors():
                async for token in tokens:
                    delta = stream.push(token)
                    ended = delta.finish_reason is not None
                    yield delta
                    if ended:
                        return
        except Cancelled:
            ended = True
            raise
        finally:
            await tokens.aclose()  # frees the sequence when the consumer walked away or a stop string hit
            self._forget(request.request_id, handle)
            if ended and ours:  # else (a crash, a takeover) a successor may still import it, until its TTL
                await self._discard_stored(prefilled.handle)

    async def _resume(self, request: GenerationRequest, prefilled: Prefilled) -> tuple[str, AsyncIterator[int], bool]:
        """The token stream after `prefilled`: the sequence parked here, else imported from the KV store,
        else recomputed from prompt + tokens so far (same seeds, so the same tokens); and whether the KV
        under `prefilled.handle` is this request's, so that the decode may free it when it ends. A handle
        off the wire may name another request's KV (a stale or forged record): that is left alone."""
        completion = (*request.resume_token_ids, prefilled.first_token_id)
        prompt_ids = await self._prompt_ids_in_thread(request)
        if self._engine.holds(prefilled.handle, (*prompt_ids, *completion), request.tenant):
            self.handoffs.local += 1
            return prefilled.handle, self._engine.decode(prefilled.handle), True
        ours = self._parked_by(request.request_id, prefilled.handle)
        if ours:  # parked by this request, but not at this point of it: a takeover after tokens were sent
            self._engine.cancel(prefilled.handle)  # (it holds the first only)
        engine_request = self._engine_request(request, prompt_ids, completion)
        handle = uuid.uuid4().hex
        if await self._import(prefilled.handle, engine_request, handle):  # the import checks prompt, salt, tokens
            self.handoffs.imported += 1
            return handle, self._engine.decode(handle), True
        self.handoffs.recomputed += 1
        return handle, self._engine.generate(engine_request, handle=handle), ours

    def _parked_by(self, request_id: str, handle: str) -> bool:
        """Whether `handle` names a sequence that this backend's prefill of `request_id` parked here
        (prefill minted the handle and registered it under the request id, as `cancel` finds it)."""
        return handle in self._handles.get(request_id, ()) and self._engine.is_parked(handle)

    async def _import(self, stored: str, request: EngineRequest, handle: str) -> bool:
        if self._store is None:
            return False
        try:
            data = await asyncio.to_thread(self._store.get, stored)
        except ValueError:  # not a handle a store accepts (another backend's, or forged)
            return False
        except OSError as exc:
            log.warning("backend=%s KV store read failed (%s); recomputing", self.name, exc)
            return False
        if data is None:
            return False
        try:
            await self._engine.import_kv(data, handle=handle, request=request)
        except (KVMismatch, RequestTooLarge) as exc:  # another model or other tokens, or no room: recompute
            log.info("backend=%s stored KV not usable (%s); recomputing", self.name, exc)
            return False
        return True

    async def _discard_stored(self, handle: str) -> None:
        """In a thread, as `put` and `get` are: a file store's delete waits for the ledger's lock, which
        another process may hold (303 ms of the event loop, measured)."""
        if self._store is not None:
            try:
                await asyncio.to_thread(self._store.delete, handle)
            except (ValueError, OSError):  # not a store handle, or already gone: nothing to free
                pass

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
            self._engine.cancel(prefilled.handle)  # the consumer left before decode took the state
            self._forget(request.request_id, prefilled.handle)

    async def cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        for handle in self._handles.pop(request_id, set()):
            self._engine.cancel(handle)

    async def aclose(self) -> None:
        """Stop the engine loop, the model thread and the tokenising thread (once the prompts given to it
        are tokenised); running requests end with `BackendClosed`."""
        await self._engine.aclose()
        self._tokenizing.shutdown(wait=False)

    def _engine_request(self, request: GenerationRequest, prompt_ids: list[int], completion: Ids[int] | None = None) -> EngineRequest:
        return EngineRequest(
            prompt_ids=tuple(prompt_ids),
            completion_ids=tuple(request.resume_token_ids if completion is None else completion),
            max_tokens=request.max_tokens,
            sampling=SamplingParams.of(request.temperature, request.top_p, request.seed),
            stop_token_ids=self._eos_ids,
            priority=Priority.BATCH if request.priority == "batch" else Priority.INTERACTIVE,
            salt=request.tenant,  # prefix-cache blocks are never shared across tenants
            speculative=self._speculative,
        )

    @contextmanager
    def _tracked(self, request_id: str) -> Iterator[str]:
        """A fresh handle, cancellable by request id while the block runs."""
        handle = uuid.uuid4().hex
        self._handles.setdefault(request_id, set()).add(handle)
        try:
            yield handle
        finally:
            self._forget(request_id, handle)

    def _prune_handles(self) -> None:
        """Forgets handles the engine no longer has. A prefill-only worker parks each prompt for a decode
        that runs elsewhere; the engine drops the oldest over `max_parked`, and nothing here heard of it,
        so every request ever prefilled stayed in `_handles`. Pruned when it outgrows what the engine can
        hold, so the cost stays a few entries a request."""
        if len(self._handles) <= self._handles_bound:
            return
        for request_id in [r for r, hs in self._handles.items() if not any(self._engine.knows(h) for h in hs)]:
            del self._handles[request_id]

    def _forget(self, request_id: str, handle: str) -> None:
        handles = self._handles.get(request_id)
        if handles is not None:
            handles.discard(handle)
            if not handles:
                del self._handles[request_id]

    async def _prompt_ids_in_thread(self, request: GenerationRequest) -> list[int]:
        """`_prompt_ids`, checked on the loop and tokenised in the tokenising thread."""
        self._check_prompt(request)
        try:
            tokenized = asyncio.get_running_loop().run_in_executor(self._tokenizing, self._tokenize, request)
        except RuntimeError as exc:  # the thread is shut down: `aclose` ran
            raise BackendClosed(f"backend {self.name} is closed") from exc
        return await tokenized

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        self._check_prompt(request)
        return self._tokenize(request)

    def _check_prompt(self, request: GenerationRequest) -> None:
        """Refuse a request without exactly one prompt, or too large to tokenise (`check_input_size`)."""
        if bool(request.messages) == (request.prompt is not None):
            raise InvalidRequest("a request needs exactly one of `messages` (chat) and `prompt` (completion)")
        self.check_input_size("the prompt", *(m.content for m in request.messages), request.prompt or "")

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        with self._tokenizer_lock:
            if request.messages:
                # Content is text: control tokens a client types are not turn boundaries (pipeline/chat_template.py).
                return chat_prompt_ids(self._tokenizer, [{"role": m.role, "content": m.content} for m in request.messages])
            return [int(t) for t in self._tokenizer(request.prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]]

    def _validate(self, request: GenerationRequest, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        if request.max_tokens < 1 or len(request.resume_token_ids) >= request.max_tokens:
            raise InvalidRequest(
                f"nothing to generate: max_tokens={request.max_tokens}, resume tokens={len(request.resume_token_ids)}"
            )
        if not (0.0 <= request.temperature < math.inf and 0.0 < request.top_p <= 1.0):  # NaN fails: one row's NaN failed the step
            raise InvalidRequest(f"bad sampling parameters: temperature={request.temperature}, top_p={request.top_p}")
        if prompt_tokens + request.max_tokens > self._context_length:
            raise InvalidRequest(
                f"prompt ({prompt_tokens}) + max_tokens ({request.max_tokens}) exceeds the context "
                f"of {self._context_length} tokens"
            )

    def _refuse_if_cancelled(self, request_id: str) -> None:
        if request_id in self._cancelled:
            raise Cancelled(f"request {request_id} was cancelled")

    def _text_stream(self, request: GenerationRequest, prefilled: Prefilled | None = None) -> TextStream:
        common = {"stops": request.stop, "max_tokens": request.max_tokens, "eos_ids": self._eos_ids}
        resume = request.resume_token_ids
        if prefilled is None:
            return TextStream.start(self._detokenize, resume_ids=resume, **common)
        if request.resume_sent_chars is not None:  # a takeover: this much of the completion's text was sent
            ids = (*resume, prefilled.first_token_id)
            return TextStream(self._detokenize, completion_ids=ids, sent_chars=request.resume_sent_chars, **common)
        return TextStream.after_first(
            self._detokenize,
            resume_ids=resume,
            first_token_id=prefilled.first_token_id,
            first_text=prefilled.first_text,
            **common,
        )

    def _detokenize(self, ids: Ids[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))


class _ParkedView:
    """The engine's parked sequences seen as the backend's KV store (handles of prefilled requests)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def __len__(self) -> int:
        return self._engine.num_parked

    def __contains__(self, handle: object) -> bool:
        return isinstance(handle, str) and self._engine.is_parked(handle)

    def drop(self, handle: str) -> bool:
        """Free the state under `handle`; False if there was none."""
        return self._engine.is_parked(handle) and self._engine.cancel(handle)


@contextmanager
def _engine_errors() -> Iterator[None]:
    """Engine errors as the backend errors the stages know (each with its policy)."""
    try:
        yield
    except SequenceAborted as exc:
        raise Cancelled(str(exc)) from exc
    except RequestTooLarge as exc:
        raise InvalidRequest(str(exc)) from exc
    except StepFailed as exc:
        raise ModelError(str(exc)) from exc
    except EngineClosed as exc:
        raise BackendClosed(str(exc)) from exc
    except EngineError as exc:
        raise BackendError(str(exc)) from exc


def _eos_ids(generation: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Tokens that end a completion: the model's and tokenizer's EOS and the chat end-of-turn token."""
    configured = generation.eos_token_id if generation is not None else None
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end_of_turn = tokenizer.get_vocab().get(END_OF_TURN)
    if end_of_turn is not None:
        ids.add(int(end_of_turn))
    return frozenset(ids)

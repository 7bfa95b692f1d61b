"""An OpenAI-compatible upstream (vLLM, SGLang, TGI, llama.cpp's server, a hosted API) as a backend.

Streams `/chat/completions` (or `/completions` for a prompt) with server-sent events over httpx and
turns each event into a `Delta`; the last one carries the upstream's usage (`stream_options.
include_usage`). A request whose client waits for the whole answer (`stream` false) is asked for in
one piece: one JSON body, one `Delta`. `base_url` and the key's environment variable come from the config file only: no
request field names an address. Cancelling closes the upstream stream (the server sees the client
leave and stops). Errors: 429 is `Overloaded` with the upstream's `retry-after`, 5xx and timeouts
`ModelError` (retriable: route may try another backend), other 4xx `InvalidRequest`. The upstream's
error body is never passed on (it may echo the prompt); its status is.

No token ids: the upstream speaks text. A successor that takes a stream over asks again and drops
what was delivered (pipeline.stages.generate).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pipeline.backends.base import Delta, GenerationRequest
from pipeline.backends.errors import BackendError, Cancelled, Filtered, InvalidRequest, ModelError, Overloaded

log = logging.getLogger(__name__)


class OpenAIBackend:
    def __init__(
        self, name: str, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"backend {name}: base_url must be an http(s) URL")
        self.name = name
        self._model = model
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout,
                                       transport=transport, follow_redirects=False, trust_env=False)
        self._running: dict[str, httpx.Response] = {}
        self._cancelled: set[str] = set()

    @classmethod
    def from_env(cls, name: str, base_url: str, model: str, api_key_env: str, timeout_s: float) -> OpenAIBackend:
        """The key is read from the environment variable the config names (never from the file)."""
        key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not key:
            raise ValueError(f"backend {name}: environment variable {api_key_env} is not set")
        return cls(name, base_url, model, api_key=key, timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)
        if (response := self._running.get(request_id)) is not None:
            await response.aclose()  # the read in `generate` ends; the upstream sees the client leave

    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._model, "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
        }
        if request.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.prompt is not None:
            return "completions", {**body, "prompt": request.prompt}
        return "chat/completions", {**body, "messages": [{"role": m.role, "content": m.content} for m in request.messages]}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        path, body = self._body(request)
        rid = request.request_id
        self._cancelled.discard(rid)
        try:
            async with self._http.stream("POST", path, json=body) as response:
                self._running[rid] = response
                if response.status_code != 200:
                    raise _refused(response)
                if not request.stream:
                    yield _whole(json.loads(await response.aread()))
                    return
                finish: str | None = None
                ended = False  # the delta with the finish reason was yielded
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    delta, finish = _event(json.loads(data), finish)
                    if delta is not None:
                        ended = delta.finish_reason is not None
                        yield delta
                if rid in self._cancelled:
                    raise Cancelled(rid)
                if finish is None:
                    raise ModelError("the upstream stream ended without a finish reason")
                if not ended:  # an upstream that sends no usage event
                    yield Delta("", (), "length" if finish == "length" else "stop")
        except (httpx.StreamClosed, httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if rid in self._cancelled:
                raise Cancelled(rid) from None
            raise ModelError(f"upstream connection failed ({type(exc).__name__})") from None
        except httpx.TimeoutException as exc:
            raise ModelError(f"upstream timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise ModelError(f"upstream unreachable ({type(exc).__name__})") from None
        except json.JSONDecodeError:
            raise ModelError("the upstream sent an event that is not JSON") from None
        finally:
            self._running.pop(rid, None)
            self._cancelled.discard(rid)


def _event(event: dict[str, Any], finish: str | None) -> tuple[Delta | None, str | None]:
    """One streamed event as a delta (None when it carries nothing), and the finish reason so far."""
    usage = event.get("usage") or None
    choices = event.get("choices") or []
    text, reason = "", None
    if choices:
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        reason = choice.get("finish_reason")
    if reason is not None:
        finish = _finish(reason)
    if usage is not None and finish is not None:  # the last event (include_usage): the counts, and the ending
        return Delta(text, (), finish, usage.get("prompt_tokens"), usage.get("completion_tokens")), finish  # type: ignore[arg-type]
    if not text:
        return None, finish
    return Delta(text, (), None), finish  # the ending waits for the usage event (or [DONE])


def _whole(answer: dict[str, Any]) -> Delta:
    """A non-streamed answer as one delta with its ending and the upstream's usage."""
    try:
        choice = answer["choices"][0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        reason = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ModelError("the upstream's answer has no choices") from None
    if reason is None:
        raise ModelError("the upstream's answer has no finish reason")
    usage = answer.get("usage") or {}
    return Delta(str(text), (), _finish(reason), usage.get("prompt_tokens"), usage.get("completion_tokens"))


def _finish(reason: object) -> str:
    """sluice's finish reason for the upstream's: `length`, or `stop` for every other ending (eos, a stop
    string, `tool_calls`, TGI's `eos_token`), except the upstream's content filter, which is an error."""
    if reason == "content_filter":
        raise Filtered("the upstream's content filter ended the answer")
    return "length" if reason == "length" else "stop"


def _refused(response: httpx.Response) -> BackendError:
    status = response.status_code
    if status == 429:
        retry = response.headers.get("retry-after")
        try:
            seconds = float(retry) if retry is not None else None
        except ValueError:
            seconds = None
        return Overloaded(f"upstream is overloaded (HTTP {status})", seconds)
    if status >= 500 or status in (408, 409):
        return ModelError(f"upstream failed (HTTP {status})")
    return InvalidRequest(f"upstream refused the request (HTTP {status})")

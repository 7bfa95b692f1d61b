"""An OpenAI-compatible upstream (vLLM, SGLang, TGI, llama.cpp's server, a hosted API) as a backend.

Streams `/chat/completions` (or `/completions` for a prompt) with server-sent events over httpx and
turns each event into a `Delta`; the last one carries the upstream's usage (`stream_options.
include_usage`). A request whose client waits for the whole answer (`stream` false) is asked for in
one piece: one JSON body, one `Delta`. `base_url` and the key's environment variable come from the config file only: no
request field names an address. Cancelling closes the upstream stream (the server sees the client
leave and stops); a request cancelled before its stream began is never asked for. Errors: 429 is
`Overloaded` with the upstream's `retry-after`, 5xx and timeouts `ModelError` (retriable: route may
try another backend), other 4xx `InvalidRequest`. The upstream's error body is never passed on (it
may echo the prompt); its status is.

No token ids: the upstream speaks text. A successor that takes a stream over asks again and drops
what was delivered (pipeline.stages.generate).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pipeline.backends.base import Delta, GenerationRequest
from pipeline.backends.errors import BackendError, Cancelled, Filtered, InvalidRequest, ModelError, Overloaded

log = logging.getLogger(__name__)
_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled (a cancel may come before its generate)


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
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # the last _CANCELLED_MEMORY cancelled

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
        """A running request's stream ends with `Cancelled`; a later `generate` of it refuses to start."""
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
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
        if rid in self._cancelled:  # cancelled before its stream began: nothing is asked (or paid for)
            raise Cancelled(rid)
        try:
            async with self._http.stream("POST", path, json=body) as response:
                self._running[rid] = response
                if rid in self._cancelled:  # cancelled while the upstream had not answered yet
                    raise Cancelled(rid)
                if response.status_code != 200:
                    raise _refused(response)
                if not request.stream:
                    whole = _whole(json.loads(await response.aread()))
                    if rid in self._cancelled:
                        raise Cancelled(rid)
                    yield whole
                    return
                finish: str | None = None
                ended = False  # the delta with the finish reason was yielded
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    if rid in self._cancelled:
                        raise Cancelled(rid)
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
        except (json.JSONDecodeError, httpx.DecodingError):
            raise ModelError("the upstream sent an event that is not JSON") from None
        finally:
            self._running.pop(rid, None)


def _event(event: Any, finish: str | None) -> tuple[Delta | None, str | None]:
    """One streamed event as a delta (None when it carries nothing), and the finish reason so far. An event
    of another shape is the upstream's failure (ModelError: retried elsewhere, counted against it)."""
    if not isinstance(event, dict):
        raise ModelError("the upstream sent an event that is not an object")
    usage = event.get("usage") or None
    choices = event.get("choices") or []
    text, reason = "", None
    if not isinstance(choices, list) or not (usage is None or isinstance(usage, dict)):
        raise ModelError("the upstream sent an event of another shape")
    if choices:
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or not (delta is None or isinstance(delta, dict)):
            raise ModelError("the upstream sent an event of another shape")
        text = (delta or {}).get("content") or choice.get("text") or ""
        reason = choice.get("finish_reason")
        if not isinstance(text, str):
            raise ModelError("the upstream sent text that is not a string")
    if reason is not None:
        finish = _finish(reason)
    if usage is not None and finish is not None:  # the last event (include_usage): the counts, and the ending
        return Delta(text, (), finish, *_counts(usage)), finish  # type: ignore[arg-type]
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
    if not isinstance(text, str):
        raise ModelError("the upstream sent text that is not a string")
    return Delta(text, (), _finish(reason), *_counts(answer.get("usage")))


def _counts(usage: object) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens from an upstream's `usage`; None for what is missing or not a count."""
    if not isinstance(usage, dict):
        return None, None
    got = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")]
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 else None for v in got)  # type: ignore[return-value]


def _finish(reason: object) -> str:
    """sluice's finish reason for the upstream's: `length`, or `stop` for every other ending (eos, a stop
    string, `tool_calls`, TGI's `eos_token`), except the upstream's content filter, which is an error."""
    if reason == "content_filter":
        raise Filtered("the upstream's content filter ended the answer")
    return "length" if reason == "length" else "stop"


MAX_RETRY_AFTER_S = 3600.0  # an upstream's Retry-After is passed on to the client up to this


def _refused(response: httpx.Response) -> BackendError:
    status = response.status_code
    if status == 429:
        retry = response.headers.get("retry-after")
        try:
            seconds = float(retry) if retry is not None else None
        except ValueError:
            seconds = None
        if seconds is not None and not 0 <= seconds <= MAX_RETRY_AFTER_S:  # NaN and inf too: not a number of seconds
            seconds = None if not math.isfinite(seconds) or seconds < 0 else MAX_RETRY_AFTER_S
        return Overloaded(f"upstream is overloaded (HTTP {status})", seconds)
    if status >= 500 or status in (408, 409):
        return ModelError(f"upstream failed (HTTP {status})")
    return InvalidRequest(f"upstream refused the request (HTTP {status})")

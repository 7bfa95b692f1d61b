"""An OpenAI-compatible upstream (vLLM, SGLang, TGI, llama.cpp's server, a hosted API) as a backend.

Streams `/chat/completions` (or `/completions` for a prompt) with server-sent events over aiohttp and
turns each event into a `Delta`; the last one carries the upstream's usage (`stream_options.
include_usage`; an upstream that sends none leaves the counts None and the stage estimates them). By
default the upstream is asked for a stream even when the client waits for the whole answer (`stream`
false): a server such as vLLM sends nothing of a non-streamed answer until all of it is generated, so the
read timeout would cap the whole generation; streamed, `timeout_s` bounds the wait between events. With
`stream_upstream = false` such a request is asked whole (one JSON body, cheaper on both sides), and
`timeout_s` bounds its generation. The deltas of a non-streamed answer are held here and given as one at
its end, so a failure midway (a dropped connection, an `abort`) still comes before anything was sent,
and the route's next backend takes it. `base_url` and the key's environment variable come from the
config file only: no request field names an address. Cancelling closes the upstream connection, before
its answer's headers or during its body (the server sees the client leave and stops); a request
cancelled before its stream began is never asked for.

Connections are kept alive and reused (at most `MAX_CONNECTIONS` per backend, none reused after
`KEEPALIVE_S` idle, under the 5 s after which uvicorn, and so vLLM and SGLang, closes an idle one). A
stream whose answer has ended returns its connection at once when the body's end has come with it, else
in the background once it comes (`_drain`), never holding the request. A kept-alive connection the
upstream closed just as it was reused (its idle timeout raced ours) fails before any answer: the request
is sent once more, not counted against the upstream (`_ask`). Certificates are checked against certifi's
roots. aiohttp rather than httpx: its parser is in C, and with the reuse the backend's CPU per request is
about a third of what it was (bench.upstream_client; docs/benchmarks.md, "Session 49"). The upstream is
trusted for its answers (it writes them), and so for its framing too: one that sent a second, unasked
response on an idle connection would have it read as the next request's answer, which one connection
per request could not do.

The body is read as bytes and split at LF only (a trailing CR dropped), as SSE defines its lines: text
holding U+2028, U+2029 or U+0085 is not cut. Bounds: a line of at most `MAX_LINE_BYTES`, a body of at
most `max_tokens * BYTES_PER_TOKEN + BODY_SLACK` bytes, and an upstream that sends no text and no ending
for `timeout_s` (keep-alive comments and empty events do not count; a delta of `reasoning_content`,
`tool_calls` or a role does) has stalled. Each is `ModelError`.

Errors: 429 is `Overloaded` with the upstream's `retry-after` (seconds or an HTTP date); 400, 413 and 422
`InvalidRequest` (the request itself); every other status (3xx, 401/403/404/405/407: the upstream's
address or key is wrong, 5xx), timeouts, a body of another shape and an ending other than a finish
(`abort`, `error`, one sluice does not know) `ModelError` (retriable: route tries another backend, and
it counts against this one's health). The upstream's error body is never passed on (it may echo the
prompt); its status is.

No token ids: the upstream speaks text. A successor that takes a stream over asks again and drops
what was delivered (pipeline.stages.generate).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import os
import ssl
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import certifi

from pipeline.backends.base import Delta, FinishReason, GenerationRequest
from pipeline.backends.errors import BackendError, Cancelled, Filtered, InvalidRequest, ModelError, Overloaded

log = logging.getLogger(__name__)
_CANCELLED_MEMORY = 4096  # request ids remembered as cancelled (a cancel may come before its generate)
MAX_LINE_BYTES = 1 << 20  # one SSE line (an event is some hundred bytes; a 600 MB one took the worker down)
BYTES_PER_TOKEN = 2048  # a body's allowance per `max_tokens`: an event per token is 150-400 bytes with its framing
BODY_SLACK = 1 << 20  # and for the rest (the usage event, keep-alive comments)
MAX_RETRY_AFTER_S = 3600.0  # an upstream's Retry-After is passed on to the client up to this
MAX_CONNECTIONS = 100  # open to one backend at a time (httpx's default, which this backend had before)
KEEPALIVE_S = 2.0  # an idle connection is not reused after this (servers close theirs after 5 s or more)
DRAIN_S = 1.0  # how long what is left of a body after the answer's ending is read in the background
DRAIN_BYTES = 1 << 16  # and how much of it: past either, the connection is closed, not reused
RETRY_WITHIN_S = 0.25  # a kept-alive connection closed within this of being taken: asked again once (`_ask`)
# The upstream's endings that are an answer, as sluice's: eos, a stop string, TGI's names, a tool call.
_ANSWERED: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop", "eos_token": "stop",
    "stop_sequence": "stop", "end_turn": "stop",
}


class OpenAIBackend:
    def __init__(
        self, name: str, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 60.0,
        stream_upstream: bool = True,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"backend {name}: base_url must be an http(s) URL")
        if "@" in urlsplit(base_url).netloc:  # the key's place is api_key_env (with both, every request failed)
            raise ValueError(f"backend {name}: base_url holds credentials; name the key's environment variable in api_key_env")
        if api_key is not None and (not api_key.isprintable() or not api_key.isascii()):  # aiohttp refuses such a header
            raise ValueError(f"backend {name}: the key holds characters a header cannot carry")
        self.name = name
        self._model = model
        self._timeout_s = timeout_s
        self._stream_upstream = stream_upstream  # False: a request the client does not stream is asked whole
        self._base_url = base_url.rstrip("/") + "/"
        # identity: the size bounds count what the upstream sent, not what a compressed body expands to
        self._headers = {"accept-encoding": "identity"} | ({"authorization": f"Bearer {api_key}"} if api_key else {})
        # sock_read: between two reads of the body (as httpx's read timeout); connect: a connection from the
        # pool, opened or reused; sock_connect: the TCP (and TLS) connect itself
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=min(timeout_s, 10.0), sock_read=timeout_s)
        self._ask_bound_s = 2 * timeout_s  # the request written, the answer's headers read (none above bounds the write)
        self._session: aiohttp.ClientSession | None = None  # made in the event loop, at the first request
        self._asking: dict[str, asyncio.Task[aiohttp.ClientResponse]] = {}  # requests whose headers have not come
        self._running: dict[str, aiohttp.ClientResponse] = {}
        self._draining: set[asyncio.Task[None]] = set()
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # the last _CANCELLED_MEMORY cancelled

    @classmethod
    def from_env(
        cls, name: str, base_url: str, model: str, api_key_env: str, timeout_s: float, *, stream_upstream: bool = True,
    ) -> OpenAIBackend:
        """The key is read from the environment variable the config names (never from the file)."""
        key = os.environ[api_key_env].strip() if api_key_env in os.environ else None  # strip: a secret file's newline
        if api_key_env and not key:
            raise ValueError(f"backend {name}: environment variable {api_key_env} is not set")
        return cls(name, base_url, model, api_key=key, timeout_s=timeout_s, stream_upstream=stream_upstream)

    async def aclose(self) -> None:
        for task in self._draining:
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # certifi's roots, as httpx used (the system's store may be missing from a slim image)
            tls = ssl.create_default_context(cafile=certifi.where())
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S, ssl=tls)
            reuses = aiohttp.TraceConfig()
            reuses.on_connection_reuseconn.append(_mark_reused)
            # trust_env off: no proxy variable sends a request elsewhere; auto_decompress off: see the headers
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, timeout=self._timeout, auto_decompress=False, trust_env=False,
                trace_configs=[reuses])
        return self._session

    async def _ask(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """The upstream's answer (its headers) to POSTing `body`; asked once more when the kept-alive
        connection it went on was closed by the upstream at once, before any answer (its idle timeout: it
        never read the request). Later than RETRY_WITHIN_S the upstream may have been generating (a whole
        answer's headers come at its end): that failure is the upstream's, not asked again. The second
        try takes whichever connection the pool gives, a new one or another kept alive."""
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            reused: dict[str, float] = {}  # "at": when a kept-alive connection was taken for it (`_mark_reused`)
            try:
                async with asyncio.timeout(self._ask_bound_s):
                    return await self._http().post(self._base_url + path, json=body, allow_redirects=False, trace_request_ctx=reused)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                quick = "at" in reused and loop.time() - reused["at"] <= RETRY_WITHIN_S
                if attempt == 2 or not quick or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
        raise AssertionError("unreachable")

    async def cancel(self, request_id: str) -> None:
        """A running request's stream ends with `Cancelled`; a later `generate` of it refuses to start."""
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        if (asking := self._asking.get(request_id)) is not None:
            asking.cancel()  # the connection closes: the upstream sees the client leave before it answered
        if (response := self._running.get(request_id)) is not None:
            response.close()  # the read in `generate` ends; the upstream sees the client leave

    def _streams(self, request: GenerationRequest) -> bool:
        """Whether the upstream is asked for a stream: always, unless `stream_upstream` is off and the client
        waits for the whole answer (the module says why)."""
        return request.stream or self._stream_upstream

    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._model, "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
            "stream": False,
        }
        if self._streams(request):
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
        response: aiohttp.ClientResponse | None = None
        answered = False  # the ending was given: what is left of the body can be drained, the connection reused
        try:
            response = await self._asked(rid, path, body)
            self._running[rid] = response
            if rid in self._cancelled:  # cancelled while the upstream had not answered yet
                raise Cancelled(rid)
            if response.status != 200:
                raise _refused(response.status, response.headers.get("retry-after"))
            if not self._streams(request):  # one JSON body: the answer, whole
                whole = await _answer(response, request.max_tokens * BYTES_PER_TOKEN + BODY_SLACK)
                if rid in self._cancelled:
                    raise Cancelled(rid)
                answered = True
                yield whole
            elif request.stream:
                async for delta in self._deltas(response, request):
                    answered = delta.finish_reason is not None  # before the yield: a consumer may stop at it
                    yield delta
            else:  # held to the end, one delta: a failure midway still comes before any chunk was sent,
                whole = await _whole(self._deltas(response, request))  # so the route's next backend takes it
                answered = True
                yield whole
        except TimeoutError as exc:  # aiohttp's own timeouts are TimeoutErrors too
            raise ModelError(f"upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientConnectorError as exc:
            raise ModelError(f"upstream unreachable ({type(exc).__name__})") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            if rid in self._cancelled:
                raise Cancelled(rid) from None
            raise ModelError(f"upstream connection failed ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:  # an answer that is not HTTP, among others
            raise ModelError(f"upstream failed ({type(exc).__name__})") from None
        finally:
            self._running.pop(rid, None)
            if response is not None:
                self._done_with(response, answered)

    async def _asked(self, rid: str, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """`_ask` in a task of its own, which `cancel` cancels: a whole answer's headers come only once it
        is generated, and a cancel must not wait for that."""
        asking = asyncio.ensure_future(self._ask(path, body))
        self._asking[rid] = asking
        try:
            return await asking
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if asking.cancelled() and rid in self._cancelled and task is not None and not task.cancelling():
                raise Cancelled(rid) from None
            raise
        finally:
            self._asking.pop(rid, None)

    def _done_with(self, response: aiohttp.ClientResponse, answered: bool) -> None:
        """Gives the response's connection back: to the pool when the whole answer was given and the body
        has ended (or ends within DRAIN_S, read in the background), else closed (a failure, a cancel, a
        consumer that stopped before the ending: the upstream sees the client leave)."""
        if not answered or response.closed or response.content.exception() is not None:
            response.close()
            return
        if response.content.is_eof():
            response.release()  # back to the pool (aiohttp closes it instead if anything of it is unread)
            return
        task = asyncio.create_task(_drain(response))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _deltas(self, response: aiohttp.ClientResponse, request: GenerationRequest) -> AsyncIterator[Delta]:
        """The stream's events as deltas, the ending last (with the usage when the upstream sent it)."""
        rid = request.request_id
        stalled = _Stall(self._timeout_s)
        finish: FinishReason | None = None
        ended = False  # the delta with the finish reason was yielded
        async for data in _data(response, request.max_tokens * BYTES_PER_TOKEN + BODY_SLACK, stalled):
            if data == "[DONE]":
                break
            if rid in self._cancelled:
                raise Cancelled(rid)
            if ended:  # past the ending (an upstream that sends its usage twice): nothing more is news
                continue
            event = _json(data)
            delta, finish = _event(event, finish)
            if _progress(event):
                stalled.moved()
            if delta is not None:
                ended = delta.finish_reason is not None
                yield delta
        if rid in self._cancelled:
            raise Cancelled(rid)
        if finish is None:
            raise ModelError("the upstream stream ended without a finish reason")
        if not ended:  # an upstream that sends no usage event
            yield Delta("", (), finish)


async def _mark_reused(session: aiohttp.ClientSession, context: Any, params: aiohttp.TraceConnectionReuseconnParams) -> None:
    if isinstance(context.trace_request_ctx, dict):  # the dict `_ask` passes as its trace_request_ctx
        context.trace_request_ctx["at"] = asyncio.get_running_loop().time()


async def _drain(response: aiohttp.ClientResponse) -> None:
    """What is left of an answer's body after its ending (`[DONE]`, the usage, the chunked terminator),
    read to its end within DRAIN_S and DRAIN_BYTES so the connection is reused; else it is closed."""
    left = DRAIN_BYTES
    try:
        async with asyncio.timeout(DRAIN_S):
            while left >= 0 and (chunk := await response.content.readany()):
                left -= len(chunk)
    except (TimeoutError, aiohttp.ClientError):
        left = -1
    if left >= 0:
        response.release()
    else:
        response.close()


async def _whole(deltas: AsyncIterator[Delta]) -> Delta:
    """A non-streamed answer's deltas as one (the text joined, the ending and counts of the last)."""
    texts: list[str] = []
    last = Delta("", ())
    async for last in deltas:
        texts.append(last.text)
    return Delta("".join(texts), (), last.finish_reason, last.prompt_tokens, last.completion_tokens)


class _Stall:
    """When an upstream that sends only keep-alive comments or empty events has stalled: `timeout_s` after
    its last text or ending (the read timeout restarts at every byte, so it never fires then)."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self.at = self._loop.time() + timeout_s

    def moved(self) -> None:
        self.at = self._loop.time() + self._timeout_s


async def _data(response: aiohttp.ClientResponse, max_body: int, stalled: _Stall) -> AsyncIterator[str]:
    """The payloads of the body's `data:` lines. The timeout wraps each read, never a yield (a timeout
    open across a yield would cancel whatever the consumer awaits meanwhile)."""
    buffer, read, scanned = bytearray(), 0, 0
    while True:
        try:
            async with asyncio.timeout_at(stalled.at):
                chunk = await response.content.readany()
        except TimeoutError:
            raise ModelError("the upstream sent no text for the backend's timeout") from None
        if not chunk:
            return
        read += len(chunk)
        if read > max_body:
            raise ModelError("the upstream's answer is larger than max_tokens allows")
        buffer += chunk
        while (end := buffer.find(b"\n", scanned)) >= 0:
            line = bytes(buffer[:end]).removesuffix(b"\r")
            del buffer[: end + 1]
            scanned = 0
            if len(line) > MAX_LINE_BYTES:
                raise ModelError("the upstream sent a line longer than the bound")
            if line.startswith(b"data:"):
                try:
                    data = line[5:].decode().strip()
                except UnicodeDecodeError:
                    raise ModelError("the upstream sent an event that is not UTF-8") from None
                yield data
        if len(buffer) > MAX_LINE_BYTES:
            raise ModelError("the upstream sent a line longer than the bound")
        scanned = len(buffer)


async def _answer(response: aiohttp.ClientResponse, max_body: int) -> Delta:
    """A whole (non-streamed) answer as one delta: its text, ending and counts. Bounded as a stream is
    (`max_body`; the read timeout between reads); another shape is the upstream's failure."""
    body = bytearray()
    while chunk := await response.content.readany():
        body += chunk
        if len(body) > max_body:
            raise ModelError("the upstream's answer is larger than max_tokens allows")
    event = _json(bytes(body), "answer")
    choices = event.get("choices") if isinstance(event, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not (message is None or isinstance(message, dict)):
        raise ModelError("the upstream sent an answer of another shape")
    text = (message or {}).get("content") or choice.get("text") or ""
    if not isinstance(text, str):
        raise ModelError("the upstream sent text that is not a string")
    reason = choice.get("finish_reason")
    if reason is None:
        raise ModelError("the upstream's answer has no finish reason")
    return Delta(text, (), _finish(reason), *_counts(event.get("usage")))


def _json(data: str | bytes, what: str = "event") -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise ModelError(f"the upstream sent an {what} that is not JSON") from None


def _progress(event: Any) -> bool:
    """Whether an event shows the upstream working: any choice with text, a finish reason or a delta that
    is not empty (a reasoning model streams `reasoning_content` for minutes before its first `content`;
    `tool_calls`, a role), or the usage. Keep-alive comments and empty events are not (`_Stall`)."""
    if not isinstance(event, dict):
        return False
    choices = event.get("choices")
    return bool(event.get("usage")) or isinstance(choices, list) and any(
        isinstance(c, dict) and (c.get("text") or c.get("finish_reason") or _filled(c.get("delta"))) for c in choices)


def _filled(delta: object) -> bool:
    return isinstance(delta, dict) and any(value not in (None, "", [], {}) for value in delta.values())


def _event(event: Any, finish: FinishReason | None) -> tuple[Delta | None, FinishReason | None]:
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
        return Delta(text, (), finish, *_counts(usage)), finish
    if not text:
        return None, finish
    return Delta(text, (), None), finish  # the ending waits for the usage event (or [DONE])


def _counts(usage: object) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens from an upstream's `usage`; None for what is missing or not a count."""
    if not isinstance(usage, dict):
        return None, None
    got = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")]
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 else None for v in got)  # type: ignore[return-value]


def _finish(reason: object) -> FinishReason:
    """sluice's finish reason for the upstream's (`_ANSWERED`). The upstream's content filter is
    `Filtered`; `abort` and `error` (vLLM: the engine dropped or failed the request) and any ending not
    known here (vLLM's `repetition`, a server's own) are `ModelError`: a cut answer is never a whole one."""
    if reason == "content_filter":
        raise Filtered("the upstream's content filter ended the answer")
    if reason in ("abort", "error"):
        raise ModelError(f"the upstream ended the answer with {reason!r}")
    if not isinstance(reason, str) or (ours := _ANSWERED.get(reason)) is None:
        raise ModelError("the upstream ended the answer with a finish reason sluice does not know")
    return ours


def _refused(status: int, retry_after: str | None = None) -> BackendError:
    """A status other than 200. Only 400, 413 and 422 blame the request; a redirect, 401/403 (the key),
    404/405 (the address) and the rest say the upstream is misconfigured or failing, which another backend
    may not be: `ModelError`, counted against this one (ejected after a streak)."""
    if status == 429:
        return Overloaded(f"upstream is overloaded (HTTP {status})", _retry_after(retry_after))
    if status in (400, 413, 422):
        return InvalidRequest(f"upstream refused the request (HTTP {status})")
    return ModelError(f"upstream failed (HTTP {status})")


def _retry_after(header: str | None) -> float | None:
    """Seconds from a Retry-After of seconds or an HTTP date (a past date: 0), up to MAX_RETRY_AFTER_S;
    None for one that is neither, NaN, infinite or negative."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, origin unknown
            when = when.replace(tzinfo=UTC)
        seconds = max(0.0, (when - datetime.now(UTC)).total_seconds())
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)

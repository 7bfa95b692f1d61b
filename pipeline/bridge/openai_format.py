"""OpenAI's JSON and sluice's types, both ways. Pure functions: no I/O, no settings, no clock.

Requests: `parse_chat` and `parse_completion` turn a decoded body into a `Parsed` whose
`request_kwargs()` go to `Client.request(...)`. A body's fields fall in three groups:

- read: `model`, `messages` or `prompt`, `n` (1 only), `stream`, `stream_options` (with `stream: true`
  only, as OpenAI) and the sampling fields `max_tokens` (or `max_completion_tokens`), `temperature`,
  `top_p`, `stop`, `seed`. Omitted, `max_tokens` is 128 and `temperature` 0.0 (`topics.requests.Sampling`),
  not OpenAI's "up to the context" and 1.0: a client that wants those sends them.
- refused: the fields in `_NO_OP` (tools, structured output, logprobs, penalties, `logit_bias`,
  completions' `echo`, `suffix`, `best_of`) change the answer and sluice does not do them; a request that
  sets one to anything but its no-op value is a 400 naming it, not an answer that quietly ignores it.
- ignored: every other field (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, ...),
  none of which changes the answer; so no request field can name a URL or a backend either.

Limits that depend on the deployment (models, `max_tokens` cap, prompt size) are ingest's to enforce, so
HTTP clients and SDK users get the same answers.

Replies: `Reply` holds what every object of one answer shares; `stream_chunk`, `stream_finish`,
`stream_usage` and `completion` build the OpenAI objects, `error_body` the error object.

Errors:

    SluiceError (pipeline.errors)
    └── BridgeError       answered with an OpenAI error body and `status`
        ├── BadRequest        400: the body is not a request we can run; `param` names the field
        ├── Unauthorized      401: no credential where `gateway.auth_required` (before the body is read)
        ├── NotFound          404: `GET /v1/models/{id}` names no configured model
        ├── RequestTimeout    408: the body did not arrive within `bridge.body_timeout_s`
        └── PayloadTooLarge   413: the body is over the bridge's size cap, refused unread
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from pipeline.errors import SluiceError
from topics.errors import ErrorCode, http_status
from topics.requests import ChatMessage, Sampling
from topics.stream import Failed, Usage

T = TypeVar("T")

Kind = Literal["chat", "completion"]
Json = dict[str, Any]

DONE_EVENT = b"data: [DONE]\n\n"
MAX_STOP = 4  # OpenAI's own limit on stop sequences

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ERROR_TYPES = {
    ErrorCode.invalid_request: "invalid_request_error",
    ErrorCode.not_found: "invalid_request_error",
    ErrorCode.content_filter: "invalid_request_error",
    ErrorCode.unauthorized: "authentication_error",
    ErrorCode.forbidden: "permission_error",
    ErrorCode.rate_limited: "rate_limit_error",
}
_encoder = msgspec.json.Encoder()


class BridgeError(SluiceError):
    """A request the bridge answers itself, with an OpenAI error body."""

    status = 400
    code = ErrorCode.invalid_request
    headers: ClassVar[dict[str, str]] = {}  # sent with the error (Retry-After on a 503)

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> Json:
        return error_body(self.message, code=self.code, param=self.param)


class BadRequest(BridgeError):
    status = 400


class PayloadTooLarge(BridgeError):
    status = 413


class Unauthorized(BridgeError):
    status = 401
    code = ErrorCode.unauthorized


class NotFound(BridgeError):
    status = 404
    code = ErrorCode.not_found


class RequestTimeout(BridgeError):
    status = 408


@dataclass(frozen=True)
class Parsed:
    """A validated OpenAI request. Exactly one of `messages` (chat) and `prompt` (completion) is set."""

    kind: Kind
    model: str
    sampling: Sampling
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk carries the usage

    def request_kwargs(self) -> Json:
        """Keyword arguments for `Client.request(...)`."""
        return {
            "model": self.model,
            "messages": self.messages,
            "prompt": self.prompt,
            "stream": self.stream,  # a non-streaming answer travels as few chunk messages as possible
            **msgspec.structs.asdict(self.sampling),
        }


def decode_body(raw: bytes) -> Json:
    """The JSON object in a request body."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec raises the latter for bad UTF-8 in a string
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:  # msgspec's depth limit: a body nested thousands deep
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_chat(body: Json) -> Parsed:
    """A `/v1/chat/completions` body."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("`messages` must be a non-empty array", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    return _parsed("chat", body, messages=messages)


def parse_completion(body: Json) -> Parsed:
    """A `/v1/completions` body; `prompt` is a string (or an array holding one string)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("`prompt` must be a non-empty string", "prompt")
    return _parsed("completion", body, prompt=prompt)


def _parsed(kind: Kind, body: Json, *, messages: tuple[ChatMessage, ...] = (), prompt: str | None = None) -> Parsed:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` must be a non-empty string", "model")
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise BadRequest("only `n` = 1 is supported", "n")
    _refuse_unsupported(kind, body)
    stream = _optional(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", "stream_options")
    if options is not None and not stream:
        raise BadRequest("`stream_options` is only allowed with `stream: true`", "stream_options")
    include_usage = _optional(options or {}, "include_usage", bool, "stream_options.include_usage") or False
    return Parsed(kind, model, _sampling(body), messages, prompt, stream, include_usage)


# Fields that change the answer and that sluice does not do, with the values that change nothing (null,
# like an absent field, always does). Any other value is refused naming the field: an answer that
# ignored `tools` or `logprobs` would look like a success and be wrong.
_SHARED_NO_OP: dict[str, tuple[object, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    # Extensions of vLLM, SGLang and TGI that OpenAI-compatible clients pass through (`extra_body`)
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
_NO_OP: dict[Kind, dict[str, tuple[object, ...]]] = {
    "chat": {
        **_SHARED_NO_OP,
        "tools": ([],),
        "functions": ([],),  # the legacy form of `tools`
        "tool_choice": ("none", "auto"),
        "function_call": ("none", "auto"),  # the legacy form of `tool_choice`
        "response_format": ({"type": "text"},),
        "logprobs": (False,),
        "top_logprobs": (0,),
        "modalities": (["text"],),
        "audio": (),  # no value but null changes nothing
        "prediction": (),
        "reasoning_effort": (),
        "web_search_options": (),
    },
    "completion": {
        **_SHARED_NO_OP,
        "echo": (False,),
        "suffix": ("",),
        "best_of": (1,),
        "logprobs": (0, False),  # completions' `logprobs` is a count
    },
}


def _refuse_unsupported(kind: Kind, body: Json) -> None:
    for name, no_ops in _NO_OP[kind].items():
        value = body.get(name)
        if value is not None and not any(_same(value, no_op) for no_op in no_ops):
            values = " or ".join(_encoder.encode(no_op).decode() for no_op in no_ops)
            allowed = f" or send {values}" if values else ""
            raise BadRequest(f"`{name}` is not supported by sluice; leave it out{allowed}", name)


def _same(value: object, no_op: object) -> bool:
    """Equal as JSON values: `true` is not 1 and `0` is not `false` (Python's == says they are)."""
    return isinstance(value, bool) is isinstance(no_op, bool) and value == no_op


def _sampling(body: Json) -> Sampling:
    fields: Json = {}
    names = {"max_tokens": "max_tokens"}  # Sampling field -> the body field it came from
    max_tokens = _optional(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", int)
    else:
        names["max_tokens"] = "max_completion_tokens"
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        value = _optional(body, name, float)
        if value is not None:
            fields[name] = value
    seed = _optional(body, "seed", int)
    if seed is not None:
        fields["seed"] = seed
    stop = _stop(body.get("stop"))
    if stop:
        fields["stop"] = stop
    return validated(lambda: msgspec.convert(fields, Sampling), names)


def validated(build: Callable[[], T], names: Mapping[str, str] | None = None) -> T:
    """`build()` (a msgspec conversion: the SDK's `Client.request`, which checks the wire schema, or the
    sampling fields), with a field past the schema's bounds answered as a 400 naming the field (`names`:
    the client's name for a schema field). Unwrapped, a bound the bridge does not check itself (a model
    name over 256 characters, ...) was a 500 with a traceback in the log over HTTP, and ended the whole
    WebSocket. msgspec's message names the bound and the field, never the value."""
    try:
        return build()
    except msgspec.ValidationError as exc:
        problem, field = _split_validation_error(str(exc))
        param = (names or {}).get(field, field) if field else None
        raise BadRequest(f"`{param}`: {problem}" if param else problem, param) from None


def _split_validation_error(message: str) -> tuple[str, str | None]:
    """("Expected `int` >= 1", "max_tokens") from msgspec's "Expected `int` >= 1 - at `$.max_tokens`"."""
    problem, sep, where = message.rpartition(" - at `$.")
    if not sep:
        return message, None
    return problem, where.rstrip("`").split("[")[0]


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("`stop` must be a non-empty string or an array of them", "stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"at most {MAX_STOP} stop sequences are allowed", "stop")
    return tuple(stops)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number"}


def _optional(body: Json, name: str, type_: type[bool] | type[int] | type[float], param: str | None = None) -> Any:
    """body[name] if present and not null, checked against `type_` (bool is not a number here)."""
    value = body.get(name)
    if value is None:
        return None
    if type_ is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif type_ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, bool)
    if not ok:
        raise BadRequest(f"`{param or name}` must be {_TYPE_NAMES[type_]}", param or name)
    if type_ is int and not -(2**63) <= value < 2**63:  # the wire format's integers are 64-bit
        raise BadRequest(f"`{param or name}` is out of range", param or name)
    if type_ is float:
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits: no float holds it
            raise BadRequest(f"`{param or name}` is out of range", param or name) from None
    return value


def _message(raw: object, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"`{where}` must be an object", where)
    role = raw.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise BadRequest(f"`{where}.role` must be one of system, developer, user, assistant", f"{where}.role")
    return ChatMessage(role=role, content=_content(raw.get("content"), f"{where}.content"))  # type: ignore[arg-type]


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"`{where}` parts must be {{\"type\": \"text\", \"text\": ...}}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"`{where}` must be a string or an array of text parts", where)


# -- replies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What every object of one answer shares."""

    kind: Kind
    request_id: str
    model: str
    created: int  # unix seconds
    include_usage: bool = False

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


def _object(reply: Reply, object_: str, choices: list[Json]) -> Json:
    return {"id": reply.id, "object": object_, "created": reply.created, "model": reply.model, "choices": choices}


def _chunk(reply: Reply, choices: list[Json]) -> Json:
    out = _object(reply, "chat.completion.chunk" if reply.kind == "chat" else "text_completion", choices)
    if reply.include_usage:
        out["usage"] = None  # as OpenAI does: every chunk has the key, only the last one a value
    return out


def stream_chunk(reply: Reply, text: str, *, first: bool = False) -> Json:
    """One streamed piece of text; the first chat chunk also carries the role."""
    if reply.kind == "completion":
        return _chunk(reply, [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])
    delta: Json = {"role": "assistant", "content": text} if first else {"content": text}
    return _chunk(reply, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])


def stream_finish(reply: Reply, finish_reason: str) -> Json:
    """The last streamed choice: no text, the finish reason."""
    if reply.kind == "completion":
        return _chunk(reply, [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}])
    return _chunk(reply, [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])


def stream_usage(reply: Reply, usage: Usage) -> Json:
    """The chunk after the last choice when `stream_options.include_usage` is set: no choices, the usage."""
    out = _chunk(reply, [])
    out["usage"] = usage_body(usage)
    return out


def completion(reply: Reply, text: str, finish_reason: str, usage: Usage) -> Json:
    """The whole answer in one object (`chat.completion` or `text_completion`)."""
    if reply.kind == "chat":
        message = {"role": "assistant", "content": text}
        out = _object(reply, "chat.completion", [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}])
    else:
        out = _object(reply, "text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])
    out["usage"] = usage_body(usage)
    return out


def models_body(models: tuple[str, ...]) -> Json:
    """`/v1/models`: OpenAI's list of model objects."""
    return {"object": "list", "data": [model_body(m) for m in models]}


def model_body(model: str) -> Json:
    """One model object: `/v1/models/{id}`, and each item of the list."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "sluice"}


def usage_body(usage: Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def error_body(message: str, *, code: ErrorCode, param: str | None = None) -> Json:
    """OpenAI's error object; `code` is sluice's error code."""
    return {"error": {"message": message, "type": error_type(code), "param": param, "code": code.value}}


def error_type(code: ErrorCode) -> str:
    return _ERROR_TYPES.get(code, "server_error" if http_status(code) >= 500 else "api_error")


def failed_error(failed: Failed) -> tuple[int, Json]:
    """The HTTP status and error body for an error terminal event."""
    return http_status(failed.code), error_body(failed.message, code=failed.code)


def to_json(obj: Json) -> bytes:
    return _encoder.encode(obj)


def sse_event(obj: Json) -> bytes:
    """One server-sent event carrying `obj`."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


__all__ = [
    "DONE_EVENT",
    "BadRequest",
    "BridgeError",
    "NotFound",
    "Parsed",
    "PayloadTooLarge",
    "RequestTimeout",
    "Unauthorized",
    "Reply",
    "completion",
    "decode_body",
    "error_body",
    "error_type",
    "failed_error",
    "model_body",
    "models_body",
    "parse_chat",
    "parse_completion",
    "sse_event",
    "stream_chunk",
    "stream_finish",
    "stream_usage",
    "to_json",
    "usage_body",
]

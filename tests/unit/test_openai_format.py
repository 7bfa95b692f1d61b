"""OpenAI bodies in, OpenAI objects out: parsing, validation errors, chunk/completion/error shapes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pipeline.bridge.openai_format import (
    DONE_EVENT,
    BadRequest,
    PayloadTooLarge,
    Reply,
    completion,
    decode_body,
    error_body,
    failed_error,
    model_body,
    models_body,
    parse_chat,
    parse_completion,
    sse_event,
    stream_chunk,
    stream_finish,
    stream_usage,
)
from topics.errors import ErrorCode
from topics.requests import ChatMessage, Sampling
from topics.stream import Failed, Usage

MODEL = "smollm2-135m-instruct"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_minimal_chat_body_gets_default_sampling() -> None:
    parsed = parse_chat(chat())
    assert parsed.kind == "chat" and parsed.model == MODEL and parsed.prompt is None
    assert parsed.messages == (ChatMessage(role="user", content="hi"),)
    assert parsed.sampling == Sampling()
    assert not parsed.stream and not parsed.include_usage


def test_every_supported_field_is_read() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": "hi"},
        ],
        max_tokens=16, temperature=0.5, top_p=0.9, stop="\n", seed=7, stream=True,
        stream_options={"include_usage": True}, n=1,
    )
    parsed = parse_chat(body)
    assert [m.role for m in parsed.messages] == ["system", "user", "assistant"]
    assert parsed.messages[1].content == "hello"
    assert parsed.sampling == Sampling(max_tokens=16, temperature=0.5, top_p=0.9, stop=("\n",), seed=7)
    assert parsed.stream and parsed.include_usage


def test_request_kwargs_build_an_sdk_request() -> None:
    kwargs = parse_chat(chat(max_tokens=8, stop=["a", "b"], temperature=1)).request_kwargs()
    assert kwargs["model"] == MODEL and kwargs["prompt"] is None
    assert kwargs["messages"] == (ChatMessage(role="user", content="hi"),)
    assert Sampling(**{k: kwargs[k] for k in ("max_tokens", "temperature", "top_p", "stop", "seed")}) == Sampling(
        max_tokens=8, temperature=1.0, stop=("a", "b")
    )
    assert isinstance(kwargs["temperature"], float)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat(chat(max_tokens=100, max_completion_tokens=5)).sampling.max_tokens == 5
    assert parse_chat(chat(max_tokens=None)).sampling.max_tokens == Sampling().max_tokens


def test_developer_role_is_a_system_message() -> None:
    body = chat(messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}])
    assert parse_chat(body).messages[0].role == "system"


def test_unknown_fields_are_ignored_including_ones_naming_a_backend() -> None:
    body = chat(base_url="http://evil.example", api_base="http://x", backend="other", user="u", metadata={"k": "v"},
                store=True, service_tier="auto", parallel_tool_calls=False)  # none of them changes the answer
    parsed = parse_chat(body)
    assert "http" not in repr(parsed)
    assert set(parsed.request_kwargs()) == {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream"}


def test_omitted_max_tokens_and_temperature_are_sluices_defaults_not_openais() -> None:
    """128 and 0.0 (greedy), where OpenAI's are "up to the context" and 1.0: README's API section says so,
    and changing them changes every answer a client gets without sending them."""
    sampling = parse_chat(chat()).sampling
    assert (sampling.max_tokens, sampling.temperature) == (128, 0.0)
    assert parse_completion({"model": MODEL, "prompt": "x"}).sampling == sampling


def test_stream_options_need_stream_true_and_null_is_no_options() -> None:
    assert parse_chat(chat(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse_chat(chat(stream_options=None)).include_usage
    for body in (chat(stream_options={"include_usage": True}), chat(stream=False, stream_options={})):
        with pytest.raises(BadRequest) as caught:
            parse_chat(body)
        assert caught.value.param == "stream_options"


# Fields that change the answer, which sluice does not do: each refused naming it, not silently ignored.
REFUSED_CHAT = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("function_call", {"name": "f"}),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("logit_bias", {"50256": -100}),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"),
    ("web_search_options", {}),
    ("top_k", 40),
    ("min_p", 0.05),
    ("repetition_penalty", 1.1),
    ("min_tokens", 8),
    ("ignore_eos", True),
    ("guided_json", {"type": "object"}),
]
REFUSED_COMPLETION = [
    ("echo", True),
    ("suffix", "the end"),
    ("best_of", 3),
    ("best_of", True),  # not 1: a boolean
    ("logprobs", 5),
    ("logprobs", True),
    ("presence_penalty", 1.0),
    ("frequency_penalty", 0.1),
    ("logit_bias", {"1": 5}),
]


@pytest.mark.parametrize(("name", "value"), REFUSED_CHAT)
def test_a_chat_feature_sluice_does_not_do_is_refused_naming_it(name: str, value: object) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_chat(chat(**{name: value}))
    assert caught.value.param == name and caught.value.status == 400
    assert caught.value.message.startswith(f"`{name}` is not supported by sluice")


@pytest.mark.parametrize(("name", "value"), REFUSED_COMPLETION)
def test_a_completion_feature_sluice_does_not_do_is_refused_naming_it(name: str, value: object) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_completion({"model": MODEL, "prompt": "x", name: value})
    assert caught.value.param == name and caught.value.status == 400
    assert "not supported by sluice" in caught.value.message


def test_their_no_op_values_are_accepted() -> None:
    no_ops = {"tools": [], "functions": [], "tool_choice": "auto", "function_call": "none",
              "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
              "frequency_penalty": 0.0, "logit_bias": {}, "modalities": ["text"],
              "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False}
    assert parse_chat(chat(**no_ops)).sampling == Sampling()
    assert parse_chat(chat(**{k: None for k in no_ops})).sampling == Sampling()  # null: as if absent
    assert parse_chat(chat(tool_choice="none")).sampling == Sampling()
    for logprobs in (0, False, None):
        body = {"model": MODEL, "prompt": "x", "echo": False, "suffix": "", "best_of": 1, "logprobs": logprobs,
                "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}}
        assert parse_completion(body).sampling == Sampling()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        (chat(model=3), "model"),
        (chat(messages=[]), "messages"),
        (chat(messages="hi"), "messages"),
        (chat(messages=["hi"]), "messages[0]"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user"}]), "messages[0].content"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
         "messages[0].content"),
        (chat(n=2), "n"),
        (chat(max_tokens="16"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=1.5), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=-1), "max_completion_tokens"),
        (chat(temperature="hot"), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(seed=1.5), "seed"),
        (chat(seed=-(2**70)), "seed"),
        (chat(max_tokens=10**24), "max_tokens"),
        (chat(stop=3), "stop"),
        (chat(stop=["a", ""]), "stop"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options=True), "stream_options"),
        (chat(stream_options={"include_usage": True}), "stream_options"),  # without `stream: true`
        (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    ],
)
def test_invalid_chat_bodies_are_bad_requests_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_chat(body)
    assert caught.value.param == param
    assert caught.value.status == 400 and caught.value.code is ErrorCode.invalid_request


def test_sampling_validation_errors_say_what_is_wrong() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_chat(chat(max_tokens=0))
    assert caught.value.message == "`max_tokens`: Expected `int` >= 1"
    assert not isinstance(caught.value, msgspec.ValidationError)


def test_a_completion_body_has_a_prompt() -> None:
    parsed = parse_completion({"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "stream": True})
    assert parsed.kind == "completion" and parsed.prompt == "Once upon" and parsed.messages == ()
    assert parsed.sampling.max_tokens == 4 and parsed.stream
    assert parse_completion({"model": MODEL, "prompt": ["one"]}).prompt == "one"


@pytest.mark.parametrize("prompt", [None, "", 5, ["a", "b"], [1]])
def test_a_completion_needs_one_string_prompt(prompt: object) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_completion({"model": MODEL, "prompt": prompt})
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"text"', b"\xff"])
def test_a_body_must_be_a_json_object(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        decode_body(raw)


def test_decode_body_returns_the_object() -> None:
    assert decode_body(b'{"model": "m"}') == {"model": "m"}


# -- replies ----------------------------------------------------------------------------------

CHAT = Reply("chat", "abc123", MODEL, 1700000000)
TEXT = Reply("completion", "abc123", MODEL, 1700000000)


def test_chat_chunks_carry_the_role_first_and_the_finish_reason_last() -> None:
    first = stream_chunk(CHAT, "Hel", first=True)
    assert first == {
        "id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}],
    }
    assert stream_chunk(CHAT, "lo")["choices"][0]["delta"] == {"content": "lo"}
    last = stream_finish(CHAT, "length")
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert "usage" not in last


def test_with_include_usage_every_chunk_has_usage_and_a_last_one_has_its_value() -> None:
    reply = Reply("chat", "abc123", MODEL, 1700000000, include_usage=True)
    assert stream_chunk(reply, "x")["usage"] is None
    assert stream_finish(reply, "stop")["usage"] is None
    usage = stream_usage(reply, Usage(prompt_tokens=5, completion_tokens=3))
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_a_chat_completion_has_the_message_and_usage() -> None:
    body = completion(CHAT, "Hello!", "stop", Usage(prompt_tokens=10, completion_tokens=2))
    assert body == {
        "id": "chatcmpl-abc123", "object": "chat.completion", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }


def test_text_completion_shapes() -> None:
    chunk = stream_chunk(TEXT, "upon", first=True)
    assert chunk["id"] == "cmpl-abc123" and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "upon", "logprobs": None, "finish_reason": None}]
    assert stream_finish(TEXT, "stop")["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    whole = completion(TEXT, "upon a time", "length", Usage(3, 4))
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "upon a time"
    assert whole["usage"]["total_tokens"] == 7


def test_models_are_an_openai_list() -> None:
    assert models_body((MODEL,)) == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "sluice"}]}
    assert model_body(MODEL) == models_body((MODEL,))["data"][0]


@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        (ErrorCode.invalid_request, 400, "invalid_request_error"),
        (ErrorCode.not_found, 404, "invalid_request_error"),
        (ErrorCode.unauthorized, 401, "authentication_error"),
        (ErrorCode.forbidden, 403, "permission_error"),
        (ErrorCode.rate_limited, 429, "rate_limit_error"),
        (ErrorCode.cancelled, 499, "api_error"),
        (ErrorCode.backend_error, 502, "server_error"),
        (ErrorCode.internal, 500, "server_error"),
    ],
)
def test_a_failed_event_becomes_an_openai_error_with_its_status(code: ErrorCode, status: int, type_: str) -> None:
    failed = Failed(id="t/r1", reply_to="llm.responses.bridge", code=code, message="nope", retriable=False, tenant="t", model="m", created_at=1.0)
    assert failed_error(failed) == (status, {"error": {"message": "nope", "type": type_, "param": None, "code": code.value}})


def test_bridge_errors_have_openai_bodies() -> None:
    bad = BadRequest("`n` must be 1", "n")
    assert bad.body() == error_body("`n` must be 1", code=ErrorCode.invalid_request, param="n")
    assert bad.body()["error"]["param"] == "n"
    assert PayloadTooLarge("too big").status == 413


def test_sse_framing() -> None:
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"

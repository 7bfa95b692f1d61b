import pytest

from tests.unit.helpers import request
from topics import codec
from topics.requests import Request
from topics.stream import Chunk, Done, Failed, FinishReason, StreamEvent, Usage


def test_round_trips_every_stream_event_through_the_union() -> None:
    events = [
        Chunk(id="t/a", reply_to="llm.responses.sdk", seq=0, text="hi", tenant="t", token_ids=(5,)),
        Done(id="t/a", reply_to="llm.responses.sdk", chunks=1, digest="x", finish_reason=FinishReason.stop, usage=Usage(1, 1),
             tenant="t", model="m", created_at=1.0),
    ]
    for event in events:
        assert codec.decode(codec.encode(event), StreamEvent) == event


@pytest.mark.parametrize("payload", [b"", b"not json", b"{}", b'{"kind":"request.v1","id":5}', b'{"kind":"request.v9"}'])
def test_invalid_payloads_raise_a_schema_error(payload: bytes) -> None:
    with pytest.raises(codec.SchemaError):
        codec.decode(payload, Request)


def test_an_older_version_is_refused_with_a_reason_that_says_so() -> None:
    v1 = codec.encode(request()).replace(b'"request.v2"', b'"request.v1"')
    with pytest.raises(codec.SchemaError, match="version"):
        codec.decode(v1, Request)


def test_schema_errors_name_the_field_not_the_value() -> None:
    secret = "sk-should-never-appear"
    bad = codec.encode(request()).replace(b'"model":', b'"max_tokens_typo":"' + secret.encode() + b'","model":')
    with pytest.raises(codec.SchemaError) as caught:
        codec.decode(bad, Request)
    assert secret not in str(caught.value)


def test_salvages_the_reply_address_of_a_broken_request() -> None:
    assert codec.salvage_reply(b'{"id":"r9","reply_to":"llm.responses.sdk","sampling":"oops"}') == ("r9", "llm.responses.sdk")
    assert codec.salvage_reply(b"garbage") == (None, None)
    assert Failed  # the terminal type a salvaged request receives


def test_the_sdk_validates_requests_as_it_builds_them() -> None:
    import msgspec

    from pipeline.sdk import Client
    from tests.unit.helpers import SETTINGS

    client = Client(SETTINGS)
    assert client.request(prompt="hi", max_tokens=3).sampling.max_tokens == 3
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        client.request(prompt="hi", max_tokens=0)


def test_a_cancellation_names_a_request_id_not_a_megabyte() -> None:
    from topics.control import Cancel, CancelReason

    for good in ("abc-123", "acme/abc-123"):
        assert codec.decode(codec.encode(Cancel(id=good, reason=CancelReason.client_gone, at=1.0)), Cancel).id == good
    for bad in ("x/" + "A" * 1_000_000, "", "a/b/c", "with space"):  # each decode and prefill worker keeps 10,000
        with pytest.raises(codec.SchemaError):
            codec.decode(codec.encode(Cancel(id=bad, reason=CancelReason.client_gone, at=1.0)), Cancel)

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


SECRET = "sk-sluice-SECRET patient has HIV"


def _with(payload: dict[str, object], path: tuple[object, ...], value: object) -> bytes:
    import msgspec

    node: object = payload
    for step in path[:-1]:
        node = node[step]  # type: ignore[index]
    node[path[-1]] = value  # type: ignore[index]
    return msgspec.json.encode(payload)


def _request_dict() -> dict[str, object]:
    import msgspec

    return msgspec.json.decode(codec.encode(request()))


def _schema_error(data: bytes, type_: object) -> str:
    with pytest.raises(codec.SchemaError) as caught:
        codec.decode(data, type_)
    return str(caught.value)


@pytest.mark.parametrize(("where", "value", "shown_path"), [
    (("messages", 0, "role"), SECRET, "$.messages[0].role"),  # a Literal
    (("priority",), SECRET, "$.priority"),  # an enum
    (("principal_token",), {"kind": SECRET, "subject": "s", "expires_at": 1.0}, "$.principal_token.kind"),
    (("sampling", SECRET), 1, "$.sampling"),  # an unknown field's name
    ((SECRET,), 1, None),  # an unknown field at the top: msgspec gives no path
    (("tenant",), 5, "$.tenant"),
])
def test_a_schema_error_names_the_field_never_the_value(where: tuple[object, ...], value: object,
                                                        shown_path: str | None) -> None:
    reason = _schema_error(_with(_request_dict(), where, value), Request)
    assert "SECRET" not in reason and "HIV" not in reason
    if shown_path is not None:
        assert reason.endswith(f" - at `{shown_path}`")


def test_a_cancellation_reason_is_not_copied_into_the_error() -> None:
    from topics.control import Cancel

    reason = _schema_error(b'{"kind":"cancel.v2","id":"a","reason":"%s","at":1}' % SECRET.encode(), Cancel)
    assert "SECRET" not in reason and reason.endswith("- at `$.reason`")


def test_a_map_key_is_not_copied_into_the_error() -> None:
    from topics.hops import Admitted

    hop = _with(_request_dict(), ("priority",), "batch")  # a valid request, to nest
    payload = b'{"kind":"admitted.v2","id":"t/r1","request":%s,"tenant":"t","principal":"p","admitted_at":1,' \
              b'"timings":{"sk_SECRET_key":"slow"}}' % hop
    reason = _schema_error(payload, Admitted)
    assert "SECRET" not in reason and "$.timings[" in reason


def test_a_path_forged_inside_an_unknown_fields_name_is_withheld() -> None:
    # msgspec writes "Object contains unknown field `<name>`": a name ending in " - at `$.x" reads as a path
    forged = _with(_request_dict(), ("x - at `$.sk_SECRET_abc",), 1)
    reason = _schema_error(forged, Request)
    assert "SECRET" not in reason and reason.startswith("Unknown field")


def test_a_schema_error_is_bounded() -> None:
    reason = _schema_error(_with(_request_dict(), ("priority",), "x" * 100_000), Request)
    assert len(reason) <= codec.REASON_MAX_CHARS


@pytest.mark.parametrize(("where", "value", "reason"), [
    (("sampling", "max_tokens"), 0, "Expected `int` >= 1 - at `$.sampling.max_tokens`"),
    (("sampling", "seed"), "x", "Expected `int | null`, got `str` - at `$.sampling.seed`"),
    (("model",), "m" * 300, "Expected `str` of length <= 256 - at `$.model`"),
    (("id",), "a b", "Expected `str` matching the field's pattern - at `$.id`"),
])
def test_a_schema_error_keeps_what_the_schema_itself_says(where: tuple[object, ...], value: object,
                                                          reason: str) -> None:
    assert _schema_error(_with(_request_dict(), where, value), Request) == reason
